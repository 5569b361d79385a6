"""Output-length predictor: encoder features → two-layer classifier over percentile buckets."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Protocol

import torch

from pdserve.tdpipe.features import FeatureFn, features_by_name

PERCENTILES = (25, 50, 75, 90, 99)
"""Bucket edges: [P0,P25), [P25,P50), [P50,P75), [P75,P90), [P90,P99), [P99,+inf)."""


class LengthPredictor(Protocol):
    """Anything that maps prompts to predicted output lengths."""

    def predict(self, prompts: list[str]) -> list[int]: ...


def load_history(path: str | Path) -> tuple[list[str], list[int]]:
    """Read a JSONL history: one `{"prompt": str, "output_len": int}` per line."""
    prompts, lengths = [], []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("output_len"), int):
            raise ValueError(f"{path}:{n}: need a string 'prompt' and an int 'output_len'")
        prompts.append(row["prompt"])
        lengths.append(row["output_len"])
    if not prompts:
        raise ValueError(f"{path}: history is empty")
    return prompts, lengths


class FallbackPredictor:
    """Predicts the historical median (or mean) for every prompt."""

    def __init__(self, lengths: list[int], use_mean: bool = False) -> None:
        if not lengths:
            raise ValueError("fallback predictor needs at least one historical length")
        self.value = round(statistics.fmean(lengths) if use_mean else statistics.median(lengths))

    def predict(self, prompts: list[str]) -> list[int]:
        return [self.value] * len(prompts)


def bucket_edges(lengths: list[int]) -> list[float]:
    ordered = sorted(lengths)
    return [ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] for p in PERCENTILES]


def bucket_of(length: int, edges: list[float]) -> int:
    return sum(1 for e in edges if length >= e)


class BucketPredictor:
    """[CLS]-feature → Linear-ReLU-Linear classifier; a bucket predicts its training mean."""

    def __init__(
        self,
        feature_name: str,
        edges: list[float],
        means: list[float],
        head: torch.nn.Sequential,
        feature_fn: FeatureFn | None = None,
    ) -> None:
        self.feature_name = feature_name
        self.edges = edges
        self.means = means
        self.head = head
        self.feature_fn = feature_fn or features_by_name(feature_name)

    @classmethod
    def train(
        cls,
        prompts: list[str],
        lengths: list[int],
        feature_name: str = "hashing",
        epochs: int = 200,
        hidden: int = 64,
        seed: int = 0,
        feature_fn: FeatureFn | None = None,
    ) -> "BucketPredictor":
        if len(prompts) != len(lengths) or len(prompts) < 8:
            raise ValueError("need at least 8 (prompt, output_len) pairs of equal count")
        fn = feature_fn or features_by_name(feature_name)
        edges = bucket_edges(lengths)
        labels = torch.tensor([bucket_of(n, edges) for n in lengths])
        num_classes = len(PERCENTILES) + 1
        sums, counts = [0.0] * num_classes, [0] * num_classes
        for n, b in zip(lengths, labels.tolist()):
            sums[b] += n
            counts[b] += 1
        overall = statistics.fmean(lengths)
        # An empty bucket (ties at an edge) predicts the overall mean, never 0.
        means = [s / c if c else overall for s, c in zip(sums, counts)]
        x = fn(prompts)
        torch.manual_seed(seed)
        head = torch.nn.Sequential(
            torch.nn.Linear(x.shape[1], hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, num_classes)
        )
        opt = torch.optim.Adam(head.parameters(), lr=1e-2)
        for _ in range(epochs):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(head(x), labels)
            loss.backward()
            opt.step()
        return cls(feature_name, edges, means, head, fn)

    def predict(self, prompts: list[str]) -> list[int]:
        if not prompts:
            return []
        with torch.no_grad():
            classes = self.head(self.feature_fn(prompts)).argmax(dim=1).tolist()
        return [round(self.means[c]) for c in classes]

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        torch.save(self.head.state_dict(), d / "head.pt")
        dims = [self.head[0].in_features, self.head[0].out_features, self.head[2].out_features]
        meta = {"feature": self.feature_name, "edges": self.edges, "means": self.means, "dims": dims}
        (d / "predictor.json").write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, directory: str | Path, feature_fn: FeatureFn | None = None) -> "BucketPredictor":
        d = Path(directory)
        if not (d / "predictor.json").exists():
            raise ValueError(f"{d}: no predictor.json (train one first)")
        meta = json.loads((d / "predictor.json").read_text())
        n_in, hidden, n_out = meta["dims"]
        head = torch.nn.Sequential(torch.nn.Linear(n_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, n_out))
        head.load_state_dict(torch.load(d / "head.pt", weights_only=True))
        return cls(meta["feature"], meta["edges"], meta["means"], head, feature_fn)


def mean_abs_error(predictor: LengthPredictor, prompts: list[str], lengths: list[int]) -> float:
    preds = predictor.predict(prompts)
    return statistics.fmean(abs(p - n) for p, n in zip(preds, lengths))
