"""The profiled cost table of a batch job, cached per (model, dtype, device, stage count, ...).

Profiling times every stage's layer slice at the job's batch sizes (`profile.py`): 30 s of a
4-minute job on the CPU. The measured stage times depend on the checkpoint, the dtype, the device,
the stage split (the key holds its layer ranges, both phases'), the torch thread count, the block
size and the attention backend, not on the job, so they are stored under a key of those
(`PDSERVE_CACHE_DIR/tdpipe-profiles/<key>.json`) and a rerun builds its table from them without
profiling. A cached profile is used only when it covers the new job's plan: decode batches up to
its largest, prefill batches up to its largest, at a decode KV length and a prompt length within
a factor of 2 (a decode step grows with the KV it reads, a prompt token with the prompt before
it); otherwise the job profiles afresh and replaces it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

from pdserve.engine.builtin import cache_root
from pdserve.engine.model_config import ModelConfig
from pdserve.tdpipe.runtime.profile import ProfilePlan, StageProfile
from pdserve.tdpipe.runtime.stage_split import pipeline_split

CACHE_VERSION = 7
"""Bump when profile.py changes what it measures, so stale profiles are not reused (2: the hand-off
and dispatch costs of `profile_comm` are part of a profile; 3: the stage split weighs the LM head,
and the key holds the split itself, so a later change of it misses the cache on its own; 4: prefills
are timed at the job's token-weighted prompt length, which a cached profile must be within 2x of;
5: CPU stages are timed side by side, as the pipeline runs them; 6: the dispatch is timed over the
control frames the runtime now sends, `wire.ControlInbox`; 7: decode steps are also timed at twice
the KV length, for the KV slope `StageProfile.decode_kv_ms`)."""


def default_cache_dir() -> Path:
    return cache_root() / "tdpipe-profiles"


def model_fingerprint(model_dir: str | Path) -> str:
    """The checkpoint's identity: its config and the name, size and mtime of each weights file
    (hashing gigabytes of weights would cost more than the profile it saves)."""
    d = Path(model_dir).resolve()
    h = hashlib.sha256(str(d).encode())
    config = d / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for f in sorted(d.glob("*.safetensors")) + sorted(d.glob("*.bin")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def cache_key(model_dir: str | Path, num_stages: int, options: dict) -> dict:
    """What the measured times depend on (`options`: profile_stages's keyword options)."""
    keep = ("dtype", "device", "block_size", "num_threads", "attention_backend")
    split = pipeline_split(ModelConfig.from_dir(model_dir), num_stages, bool(options.get("phase_split")))
    return {
        "version": CACHE_VERSION,
        "model": str(Path(model_dir).resolve()),
        "fingerprint": model_fingerprint(model_dir),
        "stages": num_stages,
        "layer_ranges": [list(r) for r in split.decode],  # as JSON reads it back: the key compares equal
        "prefill_layer_ranges": [list(r) for r in split.prefill],
        **{k: options.get(k) for k in keep},
    }


def cache_path(cache_dir: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir / f"{digest}.json"


def covers(profiles: list[StageProfile], plan: ProfilePlan) -> bool:
    """Whether cached profiles can price `plan`'s batches (module docstring)."""
    p = profiles[0]
    return (
        bool(p.decode_ms and p.prefill_ms)
        and max(p.decode_ms) >= plan.decode_max
        and max(p.prefill_ms) >= max(plan.prefill_tokens)
        and plan.decode_context / 2 <= p.decode_context <= plan.decode_context * 2
        and plan.prefill_prompt_len / 2 <= p.prefill_prompt_len <= plan.prefill_prompt_len * 2
    )


def load(path: Path, key: dict) -> list[StageProfile] | None:
    """The profiles stored at `path` for `key`; None when absent, unreadable or for another key."""
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            return None
        return [
            StageProfile(
                p["stage"],
                (p["layer_range"][0], p["layer_range"][1]),
                p["decode_context"],
                {int(n): float(t) for n, t in p["decode_ms"].items()},
                {int(n): float(t) for n, t in p["prefill_ms"].items()},
                {int(n): float(t) for n, t in p["handoff_ms"].items()},
                {int(n): float(t) for n, t in p["dispatch_ms"].items()},
                int(p.get("prefill_prompt_len", 0)),
                float(p.get("decode_kv_ms", 0.0)),
            )
            for p in data["profiles"]
        ]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(path: Path, key: dict, profiles: list[StageProfile]) -> None:
    """Write atomically (a concurrent job reads either the old file or the new one, never half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".profile-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump({"key": key, "profiles": [asdict(p) for p in profiles]}, f)
    os.replace(tmp, path)


def cached_profiles(
    model_dir: str | Path, num_stages: int, plan: ProfilePlan, cache_dir: Path | None, **options
) -> tuple[list[StageProfile], Path | None]:
    """The stage profiles for `plan`: from `cache_dir` when a cached one covers it, else measured
    now (`profile.profile_at`, `options` its keyword options) and stored there. Returns (profiles,
    the cache file they were read from, or None when they were measured now)."""
    from pdserve.tdpipe.runtime.profile import profile_at

    path = key = None
    if cache_dir is not None:
        key = cache_key(model_dir, num_stages, options)
        path = cache_path(cache_dir, key)
        cached = load(path, key)
        if cached is not None and len(cached) == num_stages and covers(cached, plan):
            return cached, path
    profiles = profile_at(model_dir, num_stages, plan, **options)
    if path is not None and key is not None:
        try:
            save(path, key, profiles)
        except OSError:  # a read-only cache costs the next run a profile, not this run its result
            pass
    return profiles, None
