"""--generation-config: generation_config.json's sampling defaults (auto), none (vllm), another file (DIR)."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.generation_defaults import generation_defaults


def write(directory, **config):
    directory.mkdir(exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_auto_reads_only_the_keys_vllm_reads(tmp_path):
    model = write(tmp_path / "m", temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, min_p=0.05,
                  max_new_tokens=7, do_sample=True, eos_token_id=2, typical_p=0.5)  # fmt: skip
    assert generation_defaults("auto", model) == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.1,
        "min_p": 0.05,
        "max_tokens": 7,
    }
    assert generation_defaults("vllm", model) == {}
    other = write(tmp_path / "other", temperature=0.0)
    assert generation_defaults(str(other), model) == {"temperature": 0.0}
    assert generation_defaults("auto", tmp_path) == {}  # no file: no defaults


def test_bad_files_are_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(str(tmp_path), tmp_path)
    with pytest.raises(ValueError, match="top_p"):
        generation_defaults("auto", write(tmp_path / "a", top_p=0))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        generation_defaults("auto", tmp_path / "b")
    with pytest.raises(ValueError, match="temperature"):
        generation_defaults("auto", write(tmp_path / "c", temperature="hot"))
