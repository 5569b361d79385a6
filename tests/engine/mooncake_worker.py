"""The Mooncake side of tests/engine/test_kv_mooncake_store.py, run inside the master's network
namespace (Mooncake clients listen on every address: they stay in there with it). Prints one JSON
line per phase; before the master-death phase it prints {"phase": "kill"} and waits for a line."""

from __future__ import annotations

import json
import sys
import time

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.kv_mooncake import PREFIX, exit_process

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [5 + i for i in range(61)]  # 15 full blocks of 4 before the last token's


def engine(model: str, url: str | None) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model, num_kv_blocks=48, block_size=4, kv_store=url))


def serve(e: LLMEngine, rid: str, prompt: list[int] = PROMPT) -> list[int]:
    e.add_request(rid, prompt, GREEDY)
    tokens: list[int] = []
    while e.has_unfinished_requests():
        for out in e.step():
            tokens += out.new_token_ids
    e.check_integrity()
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
    return tokens


def stats(e: LLMEngine) -> dict:
    assert e.store is not None
    return dict(vars(e.store.stats))


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    model, url = sys.argv[1], sys.argv[2]
    reference = serve(engine(model, None), "ref")
    a = engine(model, url)  # lends memory to the pool: what it writes lives while it does
    first = serve(a, "first")
    assert a.store is not None and a.store.drain(30)
    b = engine(model, url)
    say(phase="restore", reference=reference, first=first, second=serve(b, "second"), a=stats(a), b=stats(b))

    backend = b.store.backend  # type: ignore[union-attr]
    name = _names(b)[7]
    record = bytearray(backend.store.get(PREFIX + name))
    record[-1] ^= 0xFF  # one flipped bit of KV, as a bad disk or a bad peer would
    backend.store.upsert(PREFIX + name, bytes(record))
    c = engine(model, url)
    say(phase="corrupt", tokens=serve(c, "third"), c=stats(c))

    say(phase="kill")
    sys.stdin.readline()  # the test killed the master
    started = time.monotonic()
    tokens = serve(b, "after-death", [9 + i for i in range(61)])
    b.store.drain(30)  # type: ignore[union-attr]
    say(phase="dead", tokens=tokens, seconds=time.monotonic() - started, b=stats(b))
    for e in (a, b, c):  # a node stopping after its master died must still exit cleanly
        e.close()
    say(phase="closed")
    exit_process(0)  # as the pdserve command ends a node: Mooncake's own teardown may abort without its master


def _names(e: LLMEngine) -> list[str]:
    """The record names of PROMPT's blocks (what the store keyed them by)."""
    from pdserve.engine.block_keys import prompt_block_keys
    from pdserve.engine.kv_namespace import request_root

    root = request_root(e.kv_compatibility, None)
    return [f"{k:016x}" for k in prompt_block_keys(root, PROMPT, 4, 15)]


if __name__ == "__main__":
    main()
