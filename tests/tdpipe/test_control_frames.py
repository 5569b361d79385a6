"""The controller -> stage control channel (`tdpipe.runtime.wire`): fixed-size frames into a
receive the stage posts ahead, with an overflow message for what does not fit."""

from __future__ import annotations

import pickle
import random
import threading

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.tdpipe.runtime.controller import PipeRequest
from pdserve.tdpipe.runtime.last_stage import StageMessage
from pdserve.tdpipe.runtime.local import run_local_pipeline
from pdserve.tdpipe.runtime.profile_comm import _pair
from pdserve.tdpipe.runtime.stage_worker import StageConfig
from pdserve.tdpipe.runtime.wire import CONTROL_FRAME_BYTES, ControlInbox, control_frames


def _exchange(messages: list[object]) -> list[object]:
    """Send `messages` (the last one None) from rank 0 to an inbox at rank 1; what it read."""
    a, b = _pair()
    inbox = ControlInbox(0, irecv=lambda t: b.recv([t], 0, 0))
    got: list[object] = []

    def read() -> None:
        while True:
            got.append(inbox.recv())
            if got[-1] is None:
                return

    reader = threading.Thread(target=read)
    reader.start()
    for msg in messages:
        for frame in control_frames(msg):
            a.send([frame], 1, 0).wait()
    reader.join(timeout=60)
    assert not reader.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        inbox.recv()  # nothing is left posted after None
    return got


def _payload_of_pickled_size(size: int) -> bytes:
    """Bytes whose pickle is exactly `size` bytes long."""
    data = b"x" * (size - len(pickle.dumps(b"")))
    while len(pickle.dumps(data)) > size:
        data = data[:-1]
    assert len(pickle.dumps(data)) == size
    return data


def test_frames_carry_small_boundary_and_overflowing_messages_in_order() -> None:
    room = CONTROL_FRAME_BYTES - 8
    messages: list[object] = [
        {"batch": [1, 2, 3]},
        _payload_of_pickled_size(room),  # fills the frame exactly: no overflow
        _payload_of_pickled_size(room + 1),  # one byte over: an overflow message
        list(range(50_000)),  # several frames' worth
        "after the overflow",  # the next frame is posted only after the overflow arrived
        None,
    ]
    assert _exchange(messages) == messages


def test_frames_are_fixed_size_and_the_overflow_is_exact() -> None:
    small = control_frames("tiny")
    assert [f.numel() for f in small] == [CONTROL_FRAME_BYTES]
    big = list(range(20_000))
    frames = control_frames(big)
    size = len(pickle.dumps(big))
    assert frames[0].numel() == CONTROL_FRAME_BYTES and len(frames) == 2
    assert frames[1].numel() == size - (CONTROL_FRAME_BYTES - 8)
    assert int.from_bytes(frames[0][:8].numpy().tobytes(), "little") == size
    assert frames[0].dtype == torch.uint8


def test_a_prefill_batch_larger_than_a_frame_runs_through_the_pipeline(tiny_model_dir) -> None:
    """Two 3000-token prompts in one prefill batch: its control message (~20 KB) overflows a frame;
    the stages still compute exactly what engine.LLM does."""
    rng = random.Random(7)
    prompts = [[rng.randrange(10, 1700) for _ in range(3000)] for _ in range(2)]
    blocks = [list(range(188)), list(range(188, 376))]  # 3000 tokens in blocks of 16
    batch = ForwardBatch(["r0", "r1"], prompts[0] + prompts[1], [3000] * 2, [3000] * 2, blocks, [True] * 2)
    assert len(control_frames(StageMessage(batch))) == 2  # the premise: the message overflows
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_model_dir).generate(prompts, params)]
    reqs = [PipeRequest(f"r{i}", p, 3) for i, p in enumerate(prompts)]
    run_local_pipeline(StageConfig(str(tiny_model_dir), num_kv_blocks=400, block_size=16), 2, reqs, 8192)
    assert [r.output_ids for r in reqs] == want


def test_a_frame_claiming_an_absurd_size_is_refused_before_allocating() -> None:
    a, b = _pair()
    inbox = ControlInbox(0, irecv=lambda t: b.recv([t], 0, 0))
    frame = torch.zeros(CONTROL_FRAME_BYTES, dtype=torch.uint8)
    frame[:8] = torch.frombuffer(bytearray((1 << 62).to_bytes(8, "little")), dtype=torch.uint8)
    a.send([frame], 1, 0).wait()
    with pytest.raises(RuntimeError, match="claims"):
        inbox.recv()
