"""The profile cache of `pdserve batch` (tdpipe/runtime/profile_cache.py): keyed by what the times
depend on, used only when it covers the job's plan, written atomically, never fatal when corrupt."""

from __future__ import annotations

import json

from pdserve.tdpipe.runtime import profile_cache as pc
from pdserve.tdpipe.runtime.profile import ProfilePlan, StageProfile

OPTIONS = {"dtype": "auto", "device": "cpu", "block_size": 4, "num_threads": 1, "attention_backend": "auto"}


def _profiles() -> list[StageProfile]:
    return [
        StageProfile(
            s, (s, s + 1), 100, {1: 1.0, 8: 2.0, 32: 4.0}, {64: 5.0, 512: 20.0, 2048: 70.0}, prefill_prompt_len=50
        )
        for s in (0, 1)
    ]


def _plan(decode_max: int = 32, prefill: int = 2048, context: int = 100, prompt_len: int = 50) -> ProfilePlan:
    return ProfilePlan([1, 2, decode_max], [prefill // 2, prefill], context, prompt_len, decode_max)


def test_saved_profiles_load_back_under_their_key_only(tmp_path, tiny_model_dir) -> None:
    key = pc.cache_key(tiny_model_dir, 2, OPTIONS)
    path = pc.cache_path(tmp_path, key)
    pc.save(path, key, _profiles())
    assert pc.load(path, key) == _profiles()
    for change in ({"dtype": "bfloat16"}, {"num_threads": 2}, {"device": "cuda:0"}):
        other = pc.cache_key(tiny_model_dir, 2, {**OPTIONS, **change})
        assert pc.cache_path(tmp_path, other) != path and pc.load(path, other) is None
    assert pc.cache_key(tiny_model_dir, 3, OPTIONS) != key  # the stage count is part of the key
    # the split is part of the key: a profile taken under another split (an older pdserve's) misses
    assert key["layer_ranges"] == [[0, 2], [2, 4]]
    stale = {**key, "layer_ranges": [[0, 3], [3, 4]]}
    pc.save(pc.cache_path(tmp_path, stale), stale, _profiles())
    assert pc.cache_path(tmp_path, stale) != path and pc.load(pc.cache_path(tmp_path, stale), key) is None
    path.write_text('{"key": ')  # a torn or corrupt file is a miss, never an error
    assert pc.load(path, key) is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".profile-")]  # no temp file left


def test_a_changed_checkpoint_misses_the_cache(tmp_path, tiny_model_dir) -> None:
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    before = pc.model_fingerprint(copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert pc.model_fingerprint(copy) != before


def test_cached_profiles_price_only_plans_they_cover() -> None:
    assert pc.covers(_profiles(), _plan())
    assert pc.covers(_profiles(), _plan(decode_max=8, prefill=512, context=60))  # a smaller job
    assert not pc.covers(_profiles(), _plan(decode_max=64))  # a bigger decode batch than measured
    assert not pc.covers(_profiles(), _plan(prefill=4096))  # a bigger prefill batch than measured
    assert not pc.covers(_profiles(), _plan(context=400))  # decode steps over 4x the KV measured
    assert pc.covers(_profiles(), _plan(prompt_len=90))
    assert not pc.covers(_profiles(), _plan(prompt_len=120))  # prompts over twice as long as measured
    assert not pc.covers([StageProfile(0, (0, 1), 100, {32: 1.0}, {2048: 1.0})], _plan())  # an older, unrecorded length


def test_cached_profiles_measures_once_then_reuses(tmp_path, tiny_model_dir, monkeypatch) -> None:
    calls = []

    def fake_profile_at(model_dir, num_stages, plan, **options):
        calls.append(plan)
        return _profiles()

    monkeypatch.setattr("pdserve.tdpipe.runtime.profile.profile_at", fake_profile_at)
    first, hit = pc.cached_profiles(tiny_model_dir, 2, _plan(), tmp_path, **OPTIONS)
    assert hit is None and len(calls) == 1
    again, hit = pc.cached_profiles(tiny_model_dir, 2, _plan(decode_max=8), tmp_path, **OPTIONS)
    assert hit is not None and again == first and len(calls) == 1
    pc.cached_profiles(tiny_model_dir, 2, _plan(decode_max=64), tmp_path, **OPTIONS)  # not covered: measured
    assert len(calls) == 2
    pc.cached_profiles(tiny_model_dir, 2, _plan(), None, **OPTIONS)  # --profile-cache off
    assert len(calls) == 3
