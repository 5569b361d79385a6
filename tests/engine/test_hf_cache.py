"""--model as a Hub id: found in a fake Hugging Face cache layout (HF_HOME, HF_HUB_CACHE, --download-dir,
--revision), never downloaded; a missing id says how to download it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.hf_cache import hub_cache_dirs, resolve_model_path
from pdserve.cli import build_parser
from pdserve.commands.model_args import resolve_model_args

MAIN = "a" * 40
OLD = "b" * 40


def fake_repo(cache: Path, repo_id: str = "acme/tiny-llm") -> Path:
    """huggingface_hub's layout: refs/main -> MAIN, two snapshots, a `v1` tag -> OLD."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for commit in (MAIN, OLD):
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(OLD + "\n")
    return repo


@pytest.fixture
def no_hf_env(monkeypatch, tmp_path):
    for var in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)


def test_hf_home_hub_cache_and_download_dir_are_searched_in_that_order(no_hf_env, monkeypatch, tmp_path):
    assert hub_cache_dirs() == [tmp_path / "home" / ".cache" / "huggingface" / "hub"]
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    repo = fake_repo(tmp_path / "hf" / "hub")
    assert resolve_model_path("acme/tiny-llm") == repo / "snapshots" / MAIN
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hubcache"))  # wins over HF_HOME
    with pytest.raises(ValueError, match="hubcache"):
        resolve_model_path("acme/tiny-llm")
    repo2 = fake_repo(tmp_path / "hubcache")
    assert resolve_model_path("acme/tiny-llm") == repo2 / "snapshots" / MAIN
    repo3 = fake_repo(tmp_path / "dl")  # --download-dir wins over both
    assert resolve_model_path("acme/tiny-llm", download_dir=str(tmp_path / "dl")) == repo3 / "snapshots" / MAIN


def test_revision_is_a_ref_or_a_commit(no_hf_env, tmp_path):
    repo = fake_repo(tmp_path / "c")
    cache = str(tmp_path / "c")
    assert resolve_model_path("acme/tiny-llm", cache, "v1") == repo / "snapshots" / OLD
    assert resolve_model_path("acme/tiny-llm", cache, OLD) == repo / "snapshots" / OLD
    with pytest.raises(ValueError, match="revision dev"):
        resolve_model_path("acme/tiny-llm", cache, "dev")


def test_an_uncached_id_says_how_to_download_it(no_hf_env, tmp_path):
    with pytest.raises(ValueError) as e:
        resolve_model_path("acme/other", str(tmp_path / "c"), "v2")
    msg = str(e.value)
    assert "huggingface-cli download acme/other --revision v2 --cache-dir" in msg and "never downloads" in msg
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path("/no/such/dir")
    local = tmp_path / "ckpt"
    local.mkdir()
    assert resolve_model_path(str(local)) == local


def test_the_cli_resolves_hub_ids_and_names_the_model_after_the_id(no_hf_env, tmp_path):
    repo = fake_repo(tmp_path / "c")
    for command in ("router", "up", "prefill", "decode", "generate"):
        args = build_parser().parse_args(
            [command, "--model", "acme/tiny-llm", "--download-dir", str(tmp_path / "c"), "--revision", "v1"]
        )
        resolve_model_args(args)
        assert args.model == str(repo / "snapshots" / OLD), command
        if command != "generate":
            assert args.served_model_name == ["acme/tiny-llm"], command
    args = build_parser().parse_args(["router", "--model", "acme/tiny-llm", "--served-model-name", "x"])
    with pytest.raises(SystemExit, match="huggingface-cli download acme/tiny-llm"):
        resolve_model_args(args)  # not in the default cache
