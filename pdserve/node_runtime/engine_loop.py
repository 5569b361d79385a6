"""EngineLoop: runs an LLMEngine in its own thread and talks to the asyncio world.

The engine is not thread-safe, so every engine call goes through `call()`,
which runs it in the engine thread between steps. Step outputs are pushed to
the queues of the node's request records (`node_request.NodeRequests.deliver`: subscription, not
polling).

Busy is not hung: the engine thread says how long it has been inside one step
or command without computing a decoder layer (`stalled_seconds`). A node busy
with long prompts keeps that near zero however slow each step is; a wedged
engine thread lets it grow, and the router calls the node hung when it passes
its hung-node deadline, while the node still answers its probes.

If the engine thread dies (a bug in a step), that is a failure of the whole
node, never a silent hang: every request's next output and every pending or
later `call()` raise EngineDeadError, and `on_death` tells the node to report
NOT_SERVING and exit non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable

from pdserve.node_runtime.node_request import EngineDeadError, NodeRequests, Subscription

__all__ = ["EngineDeadError", "EngineLoop"]

log = logging.getLogger("pdserve.engine_loop")


class EngineLoop:
    """The engine thread: drain commands, step while there is work, dispatch outputs."""

    def __init__(
        self,
        engine,
        loop: asyncio.AbstractEventLoop,
        requests: NodeRequests,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self.loop = loop
        self.requests = requests
        """The node's request records: step outputs are delivered to their queues."""
        self.on_death = on_death
        """Called in the event loop with the exception that killed the engine thread."""
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._running = False
        self.load: Any = engine.load()  # no thread drives the engine yet: safe to read here
        """The engine's last `load()` (EngineLoad), published by the engine thread after every
        command, in every step once the batch is scheduled (the engine's `on_scheduled`, which the
        node points here) and whenever it is
        idle: a probe or a scrape (llm-d's endpoint picker polls every 50 ms) reads it without
        touching the not thread-safe engine, and it is never unset."""
        self._busy_since: float | None = None
        """When the engine thread began its current step or command (None while it waits for work)."""
        self._seen_progress, self._progress_at = -1, time.monotonic()
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
        if self.error is not None:
            raise EngineDeadError(f"the engine thread of this node died: {self.error!r}")
        fut = self.loop.create_future()
        self._commands.put((fn, args, kwargs, fut))
        return await fut

    def subscription(self) -> Subscription:
        """A new request's output queue (already failed if the engine thread has died)."""
        q = Subscription()
        if self.error is not None:
            q.fail()
        return q

    def _resolve(self, fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def stalled_seconds(self) -> float:
        """Seconds the engine thread has spent in its current step or command without computing a
        decoder layer; 0 while it waits for work or advances. Called from the event loop (each load
        report): the engine's layer counter is sampled then, so progress between two reports counts."""
        now, progress = time.monotonic(), self.engine.progress
        if progress != self._seen_progress:
            self._seen_progress, self._progress_at = progress, now
        busy = self._busy_since
        return 0.0 if busy is None else now - max(busy, self._progress_at)

    def _run_command(self, item) -> None:
        fn, args, kwargs, fut = item
        self._busy_since = time.monotonic()
        try:
            result, error = fn(*args, **kwargs), None
        except Exception as e:  # delivered to the caller, never kills the loop
            result, error = None, e
        finally:
            self._busy_since = None
        self.publish_load()  # a command (an admission, an abort) changes the load at once
        self.loop.call_soon_threadsafe(self._resolve, fut, result, error)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # the thread is dying: fail everyone waiting, then tell the node
            log.critical("engine thread died: %r", e, exc_info=True)
            self.error = e
            if not self.loop.is_closed():
                self.loop.call_soon_threadsafe(self._fail_waiters, e)

    def _fail_waiters(self, error: BaseException) -> None:
        """In the event loop: wake every request and pending caller with EngineDeadError."""
        self.requests.engine_died()
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            if item:
                self._resolve(item[3], None, EngineDeadError(f"the engine thread of this node died: {error!r}"))
        if self.on_death is not None:
            self.on_death(error)

    def _serve(self) -> None:
        engine = self.engine
        while self._running:
            engine.check_ranks()  # a dead tensor-parallel rank ends this thread, hence the node, at once
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
                self._busy_since = time.monotonic()
                outputs = engine.step()  # an exception here ends the thread: see _run
                self._busy_since = None
                if outputs and not self.loop.is_closed():
                    self.loop.call_soon_threadsafe(self.requests.deliver, outputs)
            if not engine.has_unfinished_requests():  # idle, or only parked requests: no step publishes
                self.publish_load()

    def publish_load(self) -> None:
        """In the engine thread: replace `load` with the engine's state now (one reference swap)."""
        self.load = self.engine.load()
