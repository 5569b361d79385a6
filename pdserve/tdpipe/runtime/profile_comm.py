"""Measure the pipeline's hand-off and dispatch costs for the simulator (`tdpipe.overheads`).

Part of the profile pass (`profile.py` times the forwards). Two gloo ranks in two threads of
this process, over the loopback transport the stages use, replay what the runtime sends:

- hand-off: one stage's hidden states (`tokens x hidden` in the model's dtype) to the next, from
  the sender's `send` to the receiver holding the tensor;
- dispatch: the controller's round trip for a decode batch of n requests: the last stage's
  `(2, n)` token tensor back to the controller, then the controller building the next
  `StageMessage` (its block tables at the job's decode KV length), pickling it into control frames
  and sending them, and the first stage reading them from its `ControlInbox`, whose receive is
  posted ahead as the runtime's is (`wire`).

Each point is the median of `repeats` trials after one warm-up; `LinearCost.fit` turns the points
into `base + per_token * n`. A thread's wake-up stands in for another process's: on a machine
whose cores are oversubscribed both include the scheduler's latency, as the real runtime does.
"""

from __future__ import annotations

import statistics
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.tdpipe.overheads import LinearCost, PipelineOverheads
from pdserve.tdpipe.runtime.last_stage import StageMessage
from pdserve.tdpipe.runtime.wire import ControlInbox, control_frames

Group = Any
"""A `dist.ProcessGroupGloo`: torch's stubs omit its point-to-point `send`/`recv`, which it has."""


def _pair() -> tuple[Group, Group]:
    """Two connected gloo ranks in this process (their constructors meet, so they run in threads)."""
    store = dist.HashStore()
    groups: list = [None, None]

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return groups[0], groups[1]


def _send_frames(group: Group, obj: object, dst: int) -> None:
    for frame in control_frames(obj):
        group.send([frame], dst, 0).wait()


def _timed(foreground: Callable[[], None], background: Callable[[], None]) -> float:
    """Milliseconds `foreground` takes while `background` runs in a thread started before it."""
    thread = threading.Thread(target=background)
    thread.start()
    t0 = time.perf_counter()
    foreground()
    elapsed = (time.perf_counter() - t0) * 1000.0
    thread.join()
    return elapsed


def _message(seqs: int, context: int, num_tokens: int, block_size: int) -> StageMessage:
    """A control message of `seqs` sequences of `context` KV tokens computing `num_tokens` new ones
    (a decode batch: num_tokens == seqs; a prefill batch: whole prompts)."""
    per_seq = -(-context // block_size)
    query = [num_tokens // seqs] * seqs
    query[-1] += num_tokens - sum(query)
    return StageMessage(
        ForwardBatch(
            request_ids=[str(1000 + i) for i in range(seqs)],
            input_ids=[17] * num_tokens,
            query_lens=query,
            context_lens=[max(context, q) for q in query],
            block_tables=[list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)],
            sample_mask=[True] * seqs,
        )
    )


def measure_overheads(
    hidden_size: int,
    dtype: torch.dtype,
    handoff_tokens: list[int],
    decode_batches: list[int],
    decode_context: int,
    block_size: int = 16,
    repeats: int = 9,
    prefill_tokens: int = 0,
    prompt_len: int = 256,
) -> tuple[dict[int, float], dict[int, float]]:
    """(hand-off ms by tokens, dispatch ms by batch tokens), medians (module docstring); dispatch
    at each decode batch size and, with `prefill_tokens`, at one prefill batch of whole prompts of
    `prompt_len` tokens."""
    a, b = _pair()  # a: the controller's end, b: the stages' end
    ping, pong = torch.zeros(1), torch.empty(1)
    for _ in range(3):  # the first messages set up the connection's buffers: not a hand-off's cost
        _timed(lambda: a.send([ping], 1, 0).wait(), lambda: b.recv([pong], 0, 0).wait())
    handoff: dict[int, float] = {}
    for n in sorted(set(handoff_tokens)):
        x, y = torch.randn(n, hidden_size).to(dtype), torch.empty(n, hidden_size, dtype=dtype)

        def there_and_back() -> None:
            a.send([x], 1, 0).wait()
            a.recv([x], 1, 0).wait()

        def echo() -> None:
            b.recv([y], 0, 0).wait()
            b.send([y], 0, 0).wait()

        # a ping-pong of the hidden states: half of it is one hand-off, wake-up included
        times = [_timed(there_and_back, echo) / 2 for _ in range(repeats + 1)]
        handoff[n] = statistics.median(times[1:])
    dispatch: dict[int, float] = {}
    # decode messages by batch size, and the largest prefill message (its token ids dominate), so
    # that the fitted per-token term spans both kinds of batch
    messages = {n: (n, decode_context) for n in decode_batches}
    if prefill_tokens:
        messages[prefill_tokens] = (max(1, prefill_tokens // max(1, prompt_len)), prompt_len)
    inbox = ControlInbox(0, irecv=lambda t: b.recv([t], 0, 0))
    for n in sorted(messages):
        seqs, context = messages[n]
        tokens, got = torch.zeros(2, seqs, dtype=torch.long), torch.empty(2, seqs, dtype=torch.long)

        def stages() -> None:  # the last stage's tokens out, the next control message in
            b.send([tokens], 0, 0).wait()
            inbox.recv()

        def controller(seqs: int = seqs, context: int = context, n: int = n) -> None:
            a.recv([got], 1, 0).wait()
            _send_frames(a, _message(seqs, context, n, block_size), 1)

        times = [_timed(stages, controller) for _ in range(repeats + 1)]
        dispatch[n] = statistics.median(times[1:])

    def close() -> None:  # the None frame: no receive is left posted on the group
        inbox.recv()

    _timed(lambda: _send_frames(a, None, 1), close)
    return handoff, dispatch


def _shares(curves: list[dict[int, float]], keep: Callable[[int], bool]) -> tuple[float, ...]:
    """Per stage, the mean over the kept points of its time over the slowest stage's."""
    points = [n for n in curves[0] if keep(n) and all(n in c for c in curves)]
    if not points:
        return ()
    ratios = [[c[n] / max(d[n] for d in curves) for n in points] for c in curves]
    means = [sum(r) / len(r) for r in ratios]
    # relative to the slowest stage on average: noise can make the per-point slowest alternate
    return tuple(max(1e-3, m / max(means)) for m in means)


def pipeline_overheads(
    decode: list[dict[int, float]],
    prefill: list[dict[int, float]],
    handoff: dict[int, float],
    dispatch: dict[int, float],
    decode_max: int,
    decode_context: int = 0,
    decode_kv_ms: tuple[float, ...] = (),
) -> PipelineOverheads:
    """The fitted overheads of profiled stages (per stage: decode and prefill curves; the measured
    hand-off and dispatch points; the KV slopes of decode steps measured at `decode_context`):
    lines through the points (zero where none were measured) and the stages' time shares, decode
    batches up to `decode_max` (the table's decode range) and prefill batches."""
    return PipelineOverheads(
        LinearCost.fit(handoff) if handoff and len(decode) > 1 else LinearCost(),
        LinearCost.fit(dispatch) if dispatch else LinearCost(),
        _shares(decode, lambda n: n <= decode_max),
        _shares(prefill, lambda n: n > decode_max),
        decode_context if any(decode_kv_ms) else 0,
        decode_kv_ms if any(decode_kv_ms) else (),
    )
