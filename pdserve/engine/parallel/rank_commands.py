"""Commands from rank 0 to the other ranks' side services, outside the step broadcast.

The step broadcast runs the model; a node also needs per-rank work that is not a step: a decode node's
ranks each receive their KV heads from a prefill node, a prefill node's ranks each send theirs
(`node_runtime.rank_kv`). Rank 0 writes one JSON line per command to a rank's stdin (the pipe that is
already its lifeline) and reads the rank's JSON replies from a second pipe; replies carry the
command's id, so a slow command (waiting for KV) does not hold up the others.

A rank runs a side service only when the engine config names one (`EngineConfig.rank_service`,
"module:factory"): the factory is called with the rank's ModelRunner and returns an object with
`handle(msg, reply)` (any thread; `reply(dict)` may be called later, from any thread) and,
optionally, `connector`: the worker side of a KvConnector (`engine.kv_connector`), which the rank
passes to every `run`. Independently of it, a rank of an engine with KV tiers below the pool runs
their share (`engine.kv_tier_rank_service.RankTiers`), which answers the commands its `ops` names.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import threading
from concurrent.futures import Future
from typing import IO, Any

from pdserve.engine.kv_connector import NO_CONNECTOR, KvConnector
from pdserve.engine.parallel.group import RankFailure


class RankCommands:
    """Rank 0's end: `call(rank, msg)` sends a command, the returned future resolves with its reply
    (or fails with RankFailure when the rank's reply pipe closes: the rank died)."""

    def __init__(self) -> None:
        self._pipes: dict[int, tuple[IO[bytes], int]] = {}
        self._pending: dict[int, tuple[int, Future]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def attach(self, rank: int, stdin: IO[bytes], reply_fd: int) -> None:
        """Rank `rank` reads commands from `stdin` and writes replies to `reply_fd` (our read end)."""
        self._pipes[rank] = (stdin, reply_fd)
        threading.Thread(target=self._read, args=(rank, reply_fd), daemon=True, name=f"tp-replies-{rank}").start()

    @property
    def ranks(self) -> list[int]:
        return sorted(self._pipes)

    def call(self, rank: int, msg: dict) -> Future:
        fut: Future = Future()
        with self._lock:
            cid = next(self._ids)
            self._pending[cid] = (rank, fut)
            try:
                stdin = self._pipes[rank][0]
                stdin.write((json.dumps({**msg, "id": cid}) + "\n").encode())
                stdin.flush()
            except (OSError, ValueError, KeyError) as e:  # closed pipe: the rank is gone
                self._pending.pop(cid, None)
                fut.set_exception(RankFailure(f"tensor-parallel rank {rank} takes no commands: {e}"))
        return fut

    def _read(self, rank: int, fd: int) -> None:
        with os.fdopen(fd, "rb") as pipe:
            for line in pipe:
                reply = json.loads(line)
                with self._lock:
                    entry = self._pending.pop(int(reply.pop("id", -1)), None)
                if entry is not None and not entry[1].done():
                    entry[1].set_result(reply)
        with self._lock:  # EOF: the rank exited; nothing it was asked will be answered
            lost = [(cid, f) for cid, (r, f) in self._pending.items() if r == rank]
            for cid, _ in lost:
                self._pending.pop(cid)
        for _, fut in lost:
            if not fut.done():
                fut.set_exception(RankFailure(f"tensor-parallel rank {rank} exited"))


class RankService:
    """A rank's end: builds the configured side service once the runner exists and serves the
    commands read from stdin (the lines after the spec); EOF on stdin ends the process."""

    def __init__(self, spec: str, reply_fd: int | None) -> None:
        self.spec = spec
        self._out = os.fdopen(reply_fd, "wb") if reply_fd is not None else None
        self._out_lock = threading.Lock()
        self._ready = threading.Event()
        self.service: Any = None
        self.tiers: Any = None
        """This rank's share of the KV tiers (`engine.kv_tier_rank_service.RankTiers`), if the engine has any."""

    def start(self, runner: Any, tiers: Any = None) -> None:
        if self.spec:
            module, _, factory = self.spec.partition(":")
            self.service = getattr(importlib.import_module(module), factory)(runner)
        self.tiers = tiers
        self._ready.set()

    @property
    def connector(self) -> KvConnector:
        """The side service's KV connector (the engine's no-op one when it has none)."""
        return getattr(self.service, "connector", None) or NO_CONNECTOR

    def serve(self, stdin: IO[bytes]) -> None:
        """Dispatch every command line until EOF (rank 0 closed the pipe or died)."""
        for line in stdin:
            msg = json.loads(line)
            self._ready.wait()
            cid = msg.pop("id", None)

            def reply(answer: dict, cid: Any = cid) -> None:
                self._send({**answer, "id": cid})

            handler = self.tiers if msg.get("op") in getattr(self.tiers, "ops", ()) else self.service
            if handler is None:
                reply({"error": f"this rank runs nothing that answers {msg.get('op')!r}"})
                continue
            try:
                handler.handle(msg, reply)
            except Exception as e:  # a bad command is answered, never the rank's death
                reply({"error": f"{type(e).__name__}: {e}"})

    def _send(self, answer: dict) -> None:
        if self._out is None:
            return
        with self._out_lock:
            try:
                self._out.write((json.dumps(answer) + "\n").encode())
                self._out.flush()
            except OSError:
                pass  # rank 0 is gone: stdin's EOF ends this process
