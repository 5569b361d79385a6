"""LayerRestores (a tier's restores copied into the pool layer by layer): what each hook waits for,
what lands early (a reused block, a reader outside a forward) and that the sources are released
exactly once. The engine-level tests are in test_kv_tier.py and test_kv_shared_store.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import torch

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.kv_restore import LayerRestores
from pdserve.engine.kv_tier import TierStats

LAYERS, BLOCKS = 3, 8


def restores() -> tuple[LayerRestores, torch.Tensor]:
    pool: Any = SimpleNamespace(tensor=torch.zeros(LAYERS, BLOCKS, 2, 4))
    return LayerRestores(pool, TierStats(), "test"), pool.tensor


def sources(n: int, seed: float) -> list[torch.Tensor]:
    return [torch.full((LAYERS, 2, 4), seed + i) + torch.arange(LAYERS).view(LAYERS, 1, 1) for i in range(n)]


def batch(*blocks: int) -> ForwardBatch:
    return ForwardBatch(["r"], [1], [1], [len(blocks) * 4], [list(blocks)], [True])


def landed(pool: torch.Tensor, blocks: list[int], srcs: list[torch.Tensor], layer: int) -> bool:
    return all(torch.equal(pool[layer, b], s[layer]) for b, s in zip(blocks, srcs))


def test_each_layer_is_waited_for_and_the_sources_released_once():
    r, pool = restores()
    srcs, released = sources(2, 10.0), []
    gate = [threading.Event() for _ in range(LAYERS)]

    def gated(layer, dst, src):  # layer L may be copied once the test opens its gate
        gate[layer].wait(5)
        dst.copy_(src)

    r.copy = gated
    r.add([3, 5], srcs, 123, time.perf_counter(), lambda: released.append(1))
    assert r.pending == 1 and not landed(pool, [3, 5], srcs, 0)  # recorded, nothing copied
    r.start(batch(3, 5))
    gate[0].set()
    r.wait_layer(0)
    assert landed(pool, [3, 5], srcs, 0) and not landed(pool, [3, 5], srcs, LAYERS - 1)
    waiter = threading.Thread(target=r.wait_layer, args=(1,))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()  # layer 1 has not landed: its wait does not return
    gate[1].set()
    waiter.join(5)
    assert not waiter.is_alive() and landed(pool, [3, 5], srcs, 1)
    gate[2].set()
    r.wait_layer(LAYERS + 4)  # an index past the pool's layers waits for the last one
    assert landed(pool, [3, 5], srcs, LAYERS - 1)
    r.done_step()
    assert r.pending == 0 and released == [1]
    assert r.stats.restored_blocks == 2 and r.stats.restored_bytes == 123 and sum(r.stats.restore_latency) == 1
    r.close()
    assert released == [1]


def test_a_batch_that_does_not_read_a_restore_does_not_wait_for_it():
    r, pool = restores()
    srcs, gate = sources(1, 1.0), threading.Event()
    r.copy = lambda layer, dst, src: (gate.wait(5), dst.copy_(src))
    r.add([6], srcs, 1, time.perf_counter(), lambda: None)
    r.start(batch(0, 1))  # started (its copies run), but this batch reads other blocks
    began = time.monotonic()
    for layer in range(LAYERS):
        r.wait_layer(layer)
    assert time.monotonic() - began < 1 and not landed(pool, [6], srcs, 0)
    r.done_step()
    assert r.pending == 1
    gate.set()
    r.start(batch(6))  # the next batch reads it: waited for
    for layer in range(LAYERS):  # every layer before any compute (a CUDA-graph replay's order)
        r.wait_layer(layer)
    assert all(landed(pool, [6], srcs, layer) for layer in range(LAYERS))
    r.done_step()
    assert r.pending == 0
    r.close()


def test_a_restore_that_never_ran_lands_before_its_block_is_reused_or_read_outside_a_forward():
    r, pool = restores()
    a, b, released = sources(2, 1.0), sources(1, 7.0), []
    r.add([1, 2], a, 1, time.perf_counter(), lambda: released.append("a"))
    r.add([4], b, 1, time.perf_counter(), lambda: released.append("b"))
    r.before_reuse(0)  # no restore into block 0: nothing happens
    assert r.pending == 2 and not released
    r.before_reuse(2)
    assert all(landed(pool, [1, 2], a, layer) for layer in range(LAYERS)) and released == ["a"]
    r.finish_all()
    assert all(landed(pool, [4], b, layer) for layer in range(LAYERS)) and released == ["a", "b"]
    assert r.pending == 0 and r.stats.hit_requests == 2
    r.close()


def test_a_failed_copy_is_redone_even_when_no_batch_waits_for_it():
    r, pool = restores()
    srcs, released, calls = sources(2, 3.0), [], []

    def failing(layer, dst, src):  # the worker's copies of layer 1 fail
        calls.append(threading.current_thread().name)
        if layer == 1 and calls[-1] == "test-restore":
            raise OSError("injected")
        dst.copy_(src)

    r.copy = failing
    r.add([2, 3], srcs, 1, time.perf_counter(), lambda: released.append(1))
    r.start(batch(7))
    for _ in range(500):  # the worker reaches the failure
        if r._active[0].error is not None:
            break
        time.sleep(0.01)
    r.done_step()  # reaped: copied here from the failed layer on, then released
    assert all(landed(pool, [2, 3], srcs, layer) for layer in range(LAYERS))
    assert released == [1] and r.pending == 0 and r.stats.restore_fallbacks == 1 and r.stats.hit_requests == 1
    assert calls.count(threading.current_thread().name) == 2 * (LAYERS - 1)  # layers 1.. redone here
    r.close()


def test_close_releases_what_never_landed():
    r, _ = restores()
    released: list[int] = []
    r.add([1], sources(1, 0.0), 1, time.perf_counter(), lambda: released.append(1))
    r.close()
    assert released == [1] and r.pending == 0 and r.stats.hit_requests == 0
