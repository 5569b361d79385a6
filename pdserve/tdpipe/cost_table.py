"""Cost tables: forward-pass time as a function of the tokens in the pass."""

from __future__ import annotations

import bisect
import csv
from dataclasses import dataclass, replace
from pathlib import Path

import os

from pdserve.tdpipe.overheads import PipelineOverheads

DATA_DIR = Path(__file__).resolve().parent / "data"
TABLES_ENV = "PDSERVE_TDPIPE_TABLES"
PUBLISHED_SOURCE = (
    "https://github.com/MLSysU/TD-Pipe, directory profiler-results/ (commit c8c531645bbc7b7b8a95345c44edd19359e27fda)"
)


def table_dirs() -> list[Path]:
    """Where named tables are looked up: $PDSERVE_TDPIPE_TABLES, tdpipe/data/, and a `tdpipe/`
    folder of the shared steering directory beside the checkout. The published L20 tables are
    third-party data and are not committed to this repository (see tdpipe/data/README.md)."""
    dirs = [Path(os.environ[TABLES_ENV])] if os.environ.get(TABLES_ENV) else []
    return dirs + [DATA_DIR, DATA_DIR.parents[3] / "shared" / "tdpipe"]


@dataclass(frozen=True)
class CostTable:
    """Execution time (ms) of one whole-model forward pass by number of tokens.

    Prefill of a batch costs the entry for its total prompt tokens; a decode step of
    a batch of `b` requests costs the entry for `b` tokens (the published L20 tables
    have no KV-length dimension). Beyond the last row the time grows linearly with
    the last row's per-token cost.
    """

    name: str
    tokens: tuple[int, ...]
    """Sorted token counts, the first one >= 1."""
    times_ms: tuple[float, ...]
    """Forward time in milliseconds for each entry of `tokens`."""
    overheads: PipelineOverheads = PipelineOverheads()
    """What a real pipeline pays besides the forwards (hand-off, dispatch, unequal stages), as
    measured by the runtime's profile pass; zero for the published tables (an ideal pipeline)."""

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.times_ms):
            raise ValueError("tokens and times_ms must be non-empty and of equal length")
        if list(self.tokens) != sorted(set(self.tokens)) or self.tokens[0] < 1:
            raise ValueError("tokens must be strictly increasing and start at >= 1")
        if any(t <= 0 for t in self.times_ms):
            raise ValueError("times_ms must be positive")

    @classmethod
    def from_csv(cls, path: str | Path) -> "CostTable":
        """Read a `Total Length,Execute Time` CSV (the TD-Pipe profiler format)."""
        path = Path(path)
        rows: dict[int, float] = {}
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                rows[int(row["Total Length"])] = float(row["Execute Time"])
        keys = sorted(rows)
        return cls(path.stem, tuple(keys), tuple(rows[k] for k in keys))

    @classmethod
    def builtin(cls, name: str = "L20-Llama-13B") -> "CostTable":
        """Load a named table (file stem) from the table directories. `analytic` is the built-in
        GPU-like table; `auto` is L20-Llama-13B when it has been downloaded, else `analytic`."""
        if name == "analytic":
            return cls.analytic()
        if name == "auto":
            try:
                return cls.builtin("L20-Llama-13B")
            except ValueError:
                return cls.analytic()
        for d in table_dirs():
            if (d / f"{name}.csv").is_file():
                return cls.from_csv(d / f"{name}.csv")
        known = sorted({p.stem for d in table_dirs() if d.is_dir() for p in d.glob("*.csv")})
        hint = (
            (
                f"; the published L20 tables are not shipped: download {name}.csv from {PUBLISHED_SOURCE} "
                f"into tdpipe/data/ or a folder named by ${TABLES_ENV}"
            )
            if name.startswith("L20")
            else ""
        )
        raise ValueError(f"unknown cost table {name!r}; known: {known}{hint}")

    @classmethod
    def analytic(
        cls, name: str = "analytic-gpu", fixed_ms: float = 33.0, per_token_ms: float = 0.2, max_tokens: int = 2048
    ) -> "CostTable":
        """A GPU-like table: a fixed cost per forward (weights read once) plus a per-token cost.
        Used by tests and when no profiled table is at hand."""
        tokens = tuple(range(1, max_tokens + 1))
        return cls(name, tokens, tuple(fixed_ms + per_token_ms * t for t in tokens))

    def scaled(self, ratio: float, name: str) -> "CostTable":
        """Every forward `ratio` times as long (its KV slope too): a degree modelled from another's
        table, or forwards slowed by processes that share their cores."""
        over = replace(self.overheads, decode_kv_ms=tuple(k * ratio for k in self.overheads.decode_kv_ms))
        return CostTable(name, self.tokens, tuple(t * ratio for t in self.times_ms), over)

    def forward_ms(self, num_tokens: int) -> float:
        """Time of one whole-model forward over `num_tokens` tokens."""
        if num_tokens <= 0:
            return 0.0
        if num_tokens > self.tokens[-1]:
            per_token = self.times_ms[-1] / self.tokens[-1]
            return self.times_ms[-1] + per_token * (num_tokens - self.tokens[-1])
        i = bisect.bisect_left(self.tokens, num_tokens)
        if self.tokens[i] == num_tokens or i == 0:
            return self.times_ms[i]
        # Linear interpolation between the neighbouring profiled points.
        t0, t1 = self.tokens[i - 1], self.tokens[i]
        w = (num_tokens - t0) / (t1 - t0)
        return self.times_ms[i - 1] * (1 - w) + self.times_ms[i] * w

    def stage_ms(self, num_tokens: int, num_stages: int) -> float:
        """Time one of `num_stages` equal pipeline stages spends on the pass."""
        return self.forward_ms(num_tokens) / num_stages

    def per_request_throughput(self, batch_size: int) -> float:
        """Decode tokens per ms per forward at `batch_size` (the paper's Achieved)."""
        return batch_size / self.forward_ms(batch_size)
