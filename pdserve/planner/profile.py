"""A latency profile: forward-pass time by tokens in the pass, one table per degree.

A degree is what one instance is given: GPUs of tensor parallelism (a profile measured per GPU),
or torch threads (a profile measured on CPU cores). Two sources:

- a TD-Pipe table (`Total Length,Execute Time` CSV, a path or a name found by `CostTable.builtin`'s
  lookup, e.g. `L20-Llama-13B`): one GPU, degree 1. Its name is `<hardware>-<model>`, so the file
  names its model;
- a JSON profile written by `pdserve plan --measure` (`measure.py`): the local model at each
  thread count, `{"model", "hardware", "unit", "tables": {degree: {"tokens", "times_ms",
  "decode_context", "decode_kv_ms"}}}`: decode steps were timed at `decode_context` KV tokens per
  sequence, and each KV token more costs `decode_kv_ms` (the batch job's `PipelineOverheads`).

A degree the profile has no table for is modelled from the nearest measured degree below it by
Amdahl's law (`SimConfig.parallel_fraction`); such a table is named `... (modelled)`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.overheads import PipelineOverheads

Unit = Literal["gpu", "core"]


def amdahl(degree: int, parallel_fraction: float) -> float:
    """Time at `degree` relative to one: the serial share stays, the parallel share divides."""
    return (1.0 - parallel_fraction) + parallel_fraction / degree


def model_key(name: str) -> str:
    """How two model names are compared: the last path part (a directory, or a Hub id's name), any case."""
    return Path(name.rstrip("/")).name.lower()


@dataclass(frozen=True)
class Profile:
    """Forward-pass times of one model on one kind of hardware, per degree."""

    model: str
    """The model the times were measured on (a Hub name or the model directory's name)."""
    hardware: str
    """Where they were measured (`L20`, `cpu`)."""
    unit: Unit
    """What a degree counts: GPUs (tensor parallelism) or CPU cores (torch threads)."""
    tables: dict[int, CostTable] = field(default_factory=dict)
    """Profiled (measured) table per degree, at least one."""

    def __post_init__(self) -> None:
        if not self.tables or min(self.tables) < 1:
            raise ValueError("a profile needs a table for at least one degree >= 1")

    def check_model(self, model: str | None) -> None:
        """ValueError when `model` is given and is not the profile's model."""
        if model and model_key(model) != model_key(self.model):
            raise ValueError(f"the profile is for {self.model!r} ({self.hardware}), not {model!r}")

    def table(self, degree: int, parallel_fraction: float) -> CostTable:
        """The table at `degree`: profiled, else modelled from the nearest profiled degree below."""
        if degree in self.tables:
            return self.tables[degree]
        base = max((d for d in self.tables if d < degree), default=min(self.tables))
        ratio = amdahl(degree, parallel_fraction) / amdahl(base, parallel_fraction)
        src = self.tables[base]
        return src.scaled(ratio, f"{src.name}@{degree} (modelled)")

    def is_profiled(self, degree: int) -> bool:
        return degree in self.tables

    def to_json(self) -> dict:
        tables = {
            str(d): {
                "tokens": list(t.tokens),
                "times_ms": list(t.times_ms),
                "decode_context": t.overheads.decode_context,
                "decode_kv_ms": list(t.overheads.decode_kv_ms),
            }
            for d, t in self.tables.items()
        }
        return {"model": self.model, "hardware": self.hardware, "unit": self.unit, "tables": tables}

    @classmethod
    def from_json(cls, data: dict, name: str) -> "Profile":
        unit = data.get("unit")
        if unit not in ("gpu", "core"):
            raise ValueError(f"{name}: unit must be 'gpu' or 'core', got {unit!r}")
        tables = {
            int(d): CostTable(
                f"{name}@{d}",
                tuple(map(int, t["tokens"])),
                tuple(map(float, t["times_ms"])),
                PipelineOverheads(
                    decode_context=int(t.get("decode_context", 0)),
                    decode_kv_ms=tuple(map(float, t.get("decode_kv_ms", ()))),
                ),
            )
            for d, t in data["tables"].items()
        }
        return cls(str(data["model"]), str(data.get("hardware", "?")), unit, tables)


def load_profile(spec: str) -> Profile:
    """A profile from a JSON file written by `--measure`, a TD-Pipe CSV path, or a table name."""
    path = Path(spec)
    if path.suffix == ".json":
        try:
            return Profile.from_json(json.loads(path.read_text()), path.stem)
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read profile {spec}: {e}") from None
    table = CostTable.from_csv(path) if path.is_file() else CostTable.builtin(spec)
    hardware, _, model = table.name.partition("-")
    return Profile(model or table.name, hardware if model else "?", "gpu", {1: table})
