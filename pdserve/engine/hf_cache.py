"""`--model org/name`: a Hugging Face Hub id found in the local Hugging Face cache, never downloaded.

The cache layout is huggingface_hub's: `<cache>/models--org--name/snapshots/<commit>/` holds the files
and `<cache>/models--org--name/refs/<branch or tag>` names the commit a revision points at. The cache
is `--download-dir` when given (vLLM passes it to huggingface_hub as `cache_dir`), else
$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub. A server must start the same way
every time and clusters often have no egress, so a missing model is an error that says how to fetch
it (`huggingface-cli download`), not a download at start.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
"""`name` or `org/name` (huggingface_hub's repo id rules, loosely): anything else is a path."""
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
DEFAULT_REVISION = "main"
"""The revision of a Hub id when none is given (huggingface_hub's default branch)."""


def hub_cache_dirs(download_dir: str | None = None) -> list[Path]:
    """The cache directories searched, in order."""
    if download_dir:
        return [Path(download_dir).expanduser()]
    hub_cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if hub_cache:
        return [Path(hub_cache).expanduser()]
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return [Path(home).expanduser() / "hub"]


def is_hub_id(model: str) -> bool:
    """True for `org/name` or `name` that is no existing path (a relative path is tried first)."""
    return bool(_HUB_ID.match(model)) and not model.startswith(".") and not Path(model).exists()


def cached_snapshot(repo_id: str, revision: str | None, cache: Path) -> Path | None:
    """The snapshot directory of `repo_id` at `revision` (a branch, tag or commit; default main) in
    one cache, or None when that cache lacks it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    rev = revision or DEFAULT_REVISION
    ref = repo / "refs" / rev
    if ref.is_file():
        rev = ref.read_text().strip()
    elif not _COMMIT.match(rev):
        return None  # a branch or tag that was never downloaded
    snapshot = repo / "snapshots" / rev
    return snapshot if (snapshot / "config.json").is_file() or (snapshot / "tokenizer.json").is_file() else None


def resolve_model_path(model: str, download_dir: str | None = None, revision: str | None = None) -> Path:
    """The local directory of `model`: the directory itself, or the cached snapshot of a Hub id.
    ValueError with the command that downloads it when it is neither."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if not is_hub_id(model):
        raise ValueError(f"model directory {model} does not exist")
    caches = hub_cache_dirs(download_dir)
    for cache in caches:
        snapshot = cached_snapshot(model, revision, cache)
        if snapshot is not None:
            return snapshot
    where = ", ".join(str(c) for c in caches)
    command = f"huggingface-cli download {model}"
    if revision:
        command += f" --revision {revision}"
    if download_dir:
        command += f" --cache-dir {download_dir}"
    raise ValueError(
        f"model {model!r} is neither a local directory nor in the Hugging Face cache "
        f"({where}{', revision ' + revision if revision else ''}); pdserve never downloads at start. "
        f"Fetch it first with `{command}` (set HF_HOME or HF_HUB_CACHE to the cache the servers read), "
        f"or pass --model a checkpoint directory"
    )
