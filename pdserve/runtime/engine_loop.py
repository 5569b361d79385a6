"""EngineLoop: runs an LLMEngine in its own thread and talks to the asyncio world.

The engine is not thread-safe, so every engine call goes through `call()`,
which runs it in the engine thread between steps. Step outputs are pushed to
per-request asyncio queues (subscription, not polling).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, Callable

log = logging.getLogger("pdserve.engine_loop")


class EngineLoop:
    """The engine thread: drain commands, step while there is work, dispatch outputs."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.loop = loop
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue] = {}
        self._running = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._running = True
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        self._commands.put(None)
        self._thread.join(timeout=10)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run fn(*args) in the engine thread and return its result (or raise its exception)."""
        fut = self.loop.create_future()
        self._commands.put((fn, args, kwargs, fut))
        return await fut

    def subscribe(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def _resolve(self, fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def _run_command(self, item) -> None:
        fn, args, kwargs, fut = item
        try:
            result, error = fn(*args, **kwargs), None
        except Exception as e:  # delivered to the caller, never kills the loop
            result, error = None, e
        self.loop.call_soon_threadsafe(self._resolve, fut, result, error)

    def _dispatch(self, outputs) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _run(self) -> None:
        engine = self.engine
        while self._running:
            # block for a command only when the engine has nothing to step
            block = not engine.has_unfinished_requests()
            try:
                item = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
            except queue.Empty:
                item = False
            while item:
                self._run_command(item)
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    item = False
            if item is None:
                return
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception:  # a bug in a step must not leave callers hanging silently
                    log.exception("engine step failed")
                    raise
                if outputs and not self.loop.is_closed():
                    self.loop.call_soon_threadsafe(self._dispatch, outputs)
