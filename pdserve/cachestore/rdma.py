"""RDMA transport, sender side: RDMA WRITE of coalesced runs over several RC QPs per receiver.

Where it runs: on real hardware through pyverbs (NOT EXERCISED on hardware: the development and
CI kernels have no InfiniBand/RoCE support), and in CI on the EMULATED verbs device
`cachestore.verbs_emu` (PDSERVE_RDMA_EMULATOR=1), in one process or across processes (its WRITEs
travel as packets over loopback sockets to the receiver's process), which follows the verbs rules
for keys, bounds, access, QP states, ACK/NAK and completions: it proves this logic, not a NIC.
Install with `pip install pdserve[rdma]` on hosts whose
rdma-core matches the pyverbs build. The verbs layer is `cachestore.rdma_verbs`, the receiver's
per-session remote access is `cachestore.rdma_access`, the memory registered for a (CUDA) pool,
GPUDirect or pinned staging, is `cachestore.rdma_memory`.

Protocol: a channel to a receiver holds `PDSERVE_RDMA_QPS` lanes (default 2), used round robin per
run. A lane is one RC QP plus its TCP control connection (same handshake as the tcp transport),
set up and driven by the lane's own thread: the engine thread (the per-layer hook) only enqueues.
Before its first WRITE for a session, a lane asks the receiver for a grant (session id + token):
memory windows bound to the session's blocks through that lane's QP, with their rkeys. It then
posts the WRITEs, polls the completion and only then sends a NOTIFY, which the receiver checks like
a TCP write header. A failed lane (error completion, refused post, lost completion) fails its
request cleanly and is torn down; the next run gets a freshly connected lane in its place.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import threading
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from pdserve.cachestore import rdma_memory
from pdserve.cachestore.geometry import PoolGeometry, Run
from pdserve.cachestore.write_queue import WriteQueue
from pdserve.cachestore.rdma_plan import MAX_WR_PER_POST, WriteRequest, plan_writes, window_for
from pdserve.cachestore.rdma_qp import QpInfo, QpState, next_state, qp_attr_values
from pdserve.cachestore.rdma_verbs import (
    COMPLETION_TIMEOUT,
    EMULATOR_ENV,
    RdmaResources,
    device_choice,
    rdma_devices,
    verbs,
)

if TYPE_CHECKING:  # loaded on first use (staging imports torch)
    from pdserve.cachestore.staging import HostStaging
    from pdserve.cachestore.tcp_sender import TcpChannel

log = logging.getLogger("pdserve.cachestore")
QPS_ENV = "PDSERVE_RDMA_QPS"
MAX_GRANT_BYTES = 4 << 20
"""Largest grant reply a lane accepts (one window per layer and run of the session's blocks)."""
GRANT_CACHE = 256
"""Sessions whose grants a lane remembers (the oldest are forgotten first)."""


class RdmaLane:
    """One RC QP to a receiver and the thread that owns it (see the module docstring)."""

    def __init__(self, client, creds, index: int, resources, reroute=None) -> None:
        self.client, self.endpoint = client, creds.endpoint
        self.index = index
        self._staging: HostStaging | None = None
        """This lane's slot of the registered staging buffer (CUDA pool without GPUDirect), reused."""
        self._resources = resources
        """Returns the channel's RdmaResources (pool registered once, shared by its lanes)."""
        self._reroute = reroute
        """Called with the runs still queued (not posted) when the lane fails: other requests'
        runs go to another lane instead of failing with this one."""
        self.broken = False
        self.error = ""
        self.poll_threads: set[str] = set()
        """Names of the threads that polled this lane's CQ (tests assert it is never the engine's)."""
        self._queue = WriteQueue()
        self._wr_ids = 0
        self._grants: collections.OrderedDict[str, list] = collections.OrderedDict()
        # set by _setup on the lane's thread; qp and cq are verbs objects (pyverbs has no types)
        self.res: RdmaResources | None = None
        self.qp: Any = None
        self.cq: Any = None
        self.control: TcpChannel | None = None
        self._peer: QpInfo | None = None
        self._thread = threading.Thread(target=self._run, name=f"cachestore-rdma-{index}", daemon=True)
        self._thread.start()

    def prepare(self, transfer) -> None:
        """Ask for `transfer`'s grant on this lane's thread now, not at its first write."""
        if not self.broken:
            self._queue.put((transfer, None, None, None, True))

    def submit(self, transfer, layer: int, run: Run, ready_event, rerouted: bool = False) -> None:
        """Any thread: enqueue only."""
        if self.broken:
            transfer._on_ack(False, self.error or "RDMA channel closed")
            return
        self._queue.put((transfer, layer, run, ready_event, rerouted))

    def _setup(self) -> None:
        from pdserve.cachestore.tcp_sender import TcpChannel

        res = self.res = self._resources()
        self.qp, self.cq = res.create_qp()
        ours = res.local_info(self.qp)
        control = self.control = TcpChannel(self.client, self.endpoint, hello=json.dumps(asdict(ours)).encode())
        if control.broken:
            raise OSError(control._connect_error)
        assert control.peer_hello is not None, "a channel opened with a hello has the peer's"
        self._peer = QpInfo(**json.loads(control.peer_hello))
        res.connect(self.qp, self._peer, responder=False)

    def _grant(self, creds) -> list:
        """The windows of `creds`' session for this QP (asked for once per session)."""
        windows = self._grants.get(creds.session_id)
        if windows is not None:
            return windows
        from pdserve.cachestore import wire
        from pdserve.cachestore.tcp_sender import connect, control_request

        assert self._peer is not None, "grants follow the QP exchange"
        request = {"grant": {"session_id": creds.session_id, "token": creds.token, "qp_num": self._peer.qp_num}}
        sock = connect(self.endpoint, self.client.secret, self.client.tls)
        try:
            status, reply = control_request(sock, json.dumps(request).encode(), MAX_GRANT_BYTES)
        finally:
            sock.close()
        if status != wire.OK:
            raise PermissionError(f"receiver refused RDMA access ({wire.REASONS.get(status, status)})")
        windows = self._grants[creds.session_id] = json.loads(reply)["windows"]
        while len(self._grants) > GRANT_CACHE:
            self._grants.popitem(last=False)
        return windows

    def _run(self) -> None:
        from pdserve.cachestore import wire

        try:
            self._setup()
        except Exception as e:  # OSError, or a verbs error: fail what is queued, never the caller
            self._fail(f"cannot set up RDMA to {self.endpoint}: {e}")
            return
        control = self.control
        assert control is not None
        for transfer, layer, run, ready_event, _ in self._queue.live():
            creds = transfer.creds
            if layer is None:  # `prepare`: the grant now, before the first layer is ready
                try:
                    self._grant(creds)
                except (OSError, ValueError, KeyError, wire.CorruptFrame) as e:  # the first write asks again
                    log.info("RDMA grant ahead of the first layer failed: %s", e)
                continue
            try:
                windows = self._grant(creds)
            except PermissionError as e:  # this request only: the lane is fine
                transfer._on_ack(False, str(e))
                continue
            except (OSError, ValueError, KeyError, wire.CorruptFrame) as e:
                transfer._on_ack(False, f"RDMA grant failed: {e}")
                continue
            try:
                self._write(layer, run, ready_event, creds, windows, transfer.heads)
            except OSError as e:
                reason = f"RDMA lane to {self.endpoint} failed: {e}"
                # broken, with its reason, before the request learns it failed: the next run gets a new
                # lane, and whoever sees `broken` also reads why
                self.error = reason
                self.broken = True
                transfer._on_ack(False, f"RDMA write failed: {e}")
                self._fail(reason)
                return
            heads, geometry = transfer.heads, self.client.geometry
            per_block = geometry.block_bytes if heads is None else geometry.heads.slice_bytes(*heads)
            self.client.metrics.add_bytes("send", run.count * per_block)
            control.submit(transfer, layer, run, None, notify=True)

    def _write(self, layer: int, run: Run, ready_event, creds, windows: list, heads=None) -> None:
        """Post the run's WRITEs (each under the window covering it) and wait for their completion;
        with `heads`, two WRITEs a block: those heads' K and V slices, into the receiver's slices."""
        self.poll_threads.add(threading.current_thread().name)
        client = self.client
        remote = PoolGeometry(creds.num_layers, int(creds.rdma["num_blocks"]), creds.block_bytes, creds.heads())
        res = self._ready()
        base = int(creds.rdma["address"])
        if res.registration.mode == rdma_memory.STAGING:
            self._write_staged(layer, run, ready_event, remote, base, windows, heads)
            return
        if ready_event is not None:  # GPUDirect: the NIC reads the pool once the layer's kernels wrote it
            ready_event.synchronize()  # this thread waits for the layer's kernels, not the engine
        for batch in plan_writes(layer, [run], client.geometry, res.address, remote, base, self._wr_ids, heads=heads):
            self._post(batch, windows)

    def _post(self, batch: list, windows: list) -> None:
        """Post one batch of WRITEs (`RdmaResources.run_chain`: pieces that fit the send queue, only
        their last WR signaled) and wait for its completion."""
        res = self._ready()
        v = res.v
        self._wr_ids += len(batch)
        wrs = []
        for w in batch:
            wr = v.SendWR(
                wr_id=w.wr_id,
                opcode=v.enums.IBV_WR_RDMA_WRITE,
                num_sge=1,
                sg=[v.SGE(w.local_addr, w.length, res.mr.lkey)],
                send_flags=0,
            )
            wr.set_wr_rdma(window_for(windows, w.remote_addr, w.length), w.remote_addr)
            wrs.append(wr)
        res.run_chain(self.qp, self.cq, wrs)

    def _write_staged(
        self,
        layer: int,
        run: Run,
        ready_event,
        remote: PoolGeometry,
        remote_base: int,
        windows: list,
        heads: tuple[int, int] | None = None,
    ) -> None:
        """CUDA pool without GPUDirect: copy the run (in slot-sized pieces) device-to-host into this
        lane's registered slot, after the layer's CUDA event (a GPU-side wait on the staging stream,
        on this thread), and WRITE from there. The slot is reused once the WRITE completed. With
        `heads`, each block's K and V slices of those heads are gathered back to back into the slot
        and each WRITE goes from its place there into the receiver's slice."""
        from pdserve.cachestore.staging import HostStaging

        reg, geometry = self._ready().registration, self.client.geometry
        assert reg.staging is not None, "staged writes go through the registered staging buffer"
        if self._staging is None:
            slot = reg.staging[self.index * reg.slot_bytes : (self.index + 1) * reg.slot_bytes]
            self._staging = HostStaging(buffer=slot)
        staging, pool = self._staging, self.client.region.tensor
        assert pool is not None, "staging serves a device pool"
        slot_address = reg.address + self.index * reg.slot_bytes
        per_block = geometry.block_bytes if heads is None else geometry.heads.slice_bytes(*heads)
        per = max(1, reg.slot_bytes // per_block)
        for first in range(0, run.count, per):
            piece = Run(run.src_block + first, run.dst_block + first, min(per, run.count - first))
            wrs = [
                w
                for batch in plan_writes(layer, [piece], geometry, 0, remote, remote_base, self._wr_ids, heads=heads)
                for w in batch
            ]
            staging.gather(pool, [(w.local_addr, w.length) for w in wrs], ready_event)
            ready_event = None  # waited on once per run
            offsets = itertools.accumulate((w.length for w in wrs), initial=0)
            self._post([w._replace(local_addr=slot_address + o) for w, o in zip(wrs, offsets)], windows)

    def _ready(self) -> RdmaResources:
        assert self.res is not None, "the lane writes only after its setup"
        return self.res

    def _fail(self, reason: str) -> None:
        """Mark the lane broken (its channel replaces it). Runs still queued here were never posted:
        they move to another lane once (a second failure fails them), so one request's broken QP
        does not fail the others queued behind it."""
        self.error = reason  # first: another thread that sees `broken` reads why
        self.broken = True
        log.warning("%s", reason)
        self._teardown()
        for item in self._queue.drain():
            if item[0].failed or item[1] is None:  # a failed transfer's write, or a grant ahead of time
                continue
            if self._reroute is not None and not item[4]:
                self._reroute(*item[:4])
            else:
                item[0]._on_ack(False, reason)

    def _teardown(self) -> None:
        if self.control is not None:
            self.control.close()
        if self.qp is not None and hasattr(self.qp, "close"):
            self.qp.close()

    def close(self) -> None:
        self.broken = True
        self._queue.close()
        self._teardown()


class RdmaChannel:
    """Several lanes (RC QPs) to one receiver, used round robin per run; a broken lane is replaced
    by a new one (new QP, new control connection) at its next turn."""

    def __init__(self, client, creds, num_qps: int | None = None) -> None:
        self.client, self.creds = client, creds
        self.num_qps = num_qps or max(1, int(os.environ.get(QPS_ENV, "2")))
        self.broken = False
        self.replaced = 0
        """Lanes torn down and re-established so far."""
        self._lock = threading.Lock()
        self._res_lock = threading.Lock()
        self._res: RdmaResources | None = None
        self._next = 0
        self.lanes = [RdmaLane(client, creds, i, self._resources, self._reroute) for i in range(self.num_qps)]

    def _resources(self) -> RdmaResources:
        """Lane threads: open the device and register the pool on first use (off the event loop)."""
        with self._res_lock:
            if self._res is None:
                device, port, gid_index = device_choice()
                self._res = RdmaResources(
                    device,
                    self.client.region,
                    port=port,
                    gid_index=gid_index,
                    lanes=self.num_qps,
                    block_bytes=self.client.geometry.block_bytes,
                )
                rdma_memory.report(self._res.registration, self.client.metrics, "sender")
            return self._res

    def _reroute(self, transfer, layer: int, run: Run, ready_event) -> None:
        self.submit(transfer, layer, run, ready_event, rerouted=True)

    def submit(self, transfer, layer: int, run: Run, ready_event, rerouted: bool = False) -> None:
        """Engine thread: pick the next lane (replacing it if it broke) and enqueue."""
        with self._lock:
            if self.broken:
                lane = None
            else:
                i = self._next
                self._next = (i + 1) % self.num_qps
                lane = self.lanes[i]
                if lane.broken:
                    lane.close()
                    lane = self.lanes[i] = RdmaLane(self.client, self.creds, i, self._resources, self._reroute)
                    self.replaced += 1
        if lane is None:
            transfer._on_ack(False, "RDMA channel closed")
        else:
            lane.submit(transfer, layer, run, ready_event, rerouted)

    def submit_layer(self, transfer, layer: int, runs: list[Run], ready_event) -> None:
        for run in runs:
            self.submit(transfer, layer, run, ready_event)

    def prepare(self, transfer) -> None:
        """Every lane asks for the session's grant on its own thread as the transfer opens, so the
        first layer finds its windows bound (a lane's QP exchange started when the channel was made)."""
        with self._lock:
            lanes = [] if self.broken else list(self.lanes)
        for lane in lanes:
            lane.prepare(transfer)

    @property
    def poll_threads(self) -> set[str]:
        return set().union(*(lane.poll_threads for lane in self.lanes))

    def close(self) -> None:
        with self._lock:
            self.broken = True
            lanes = list(self.lanes)
        for lane in lanes:
            lane.close()
        with self._res_lock:
            if self._res is not None:
                self._res.close()
