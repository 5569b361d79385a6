"""The emulated device and its fabric: this process's QPs and remote keys, its wire endpoint, fault hooks.

EMULATED (proves verbs logic, not a NIC). One process holds one fabric, i.e. one emulated device
(every Context opened here is another open of it). QPs connected with an emulated GID (what
`Context.query_gid` returns, and what the rdma transport exchanges) reach their peer over the wire
(`verbs_emu.wire`: a loopback socket per QP connection), in this process or another one. QPs moved
to RTR without a GID reach a QP of this process by number alone (the in-process path the unit tests
of the verbs rules use). Remote keys are looked up at the responder on every access, exactly when a
NIC checks them, so a key invalidated between post and execution is refused.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from pdserve.cachestore.verbs_emu import enums
from pdserve.cachestore.verbs_emu.params import GID

DEVICE_NAME = "emu_rdma0"


@dataclass
class FaultHooks:
    """Faults the tests inject. All default to "off"."""

    write_delay_s: float = 0.0
    """Each RDMA WRITE waits this long in its QP's send engine before it executes (in order)."""
    drop_completions: int = 0
    """The next N completions that would be queued are lost (a NIC/driver losing a CQE)."""

    @classmethod
    def from_env(cls) -> "FaultHooks":
        """Hooks for a child process (a cluster node): $PDSERVE_RDMA_EMU_WRITE_DELAY_S and
        $PDSERVE_RDMA_EMU_DROP_COMPLETIONS (test-only, like the tcp fault env)."""
        return cls(
            write_delay_s=float(os.environ.get("PDSERVE_RDMA_EMU_WRITE_DELAY_S", "0") or 0),
            drop_completions=int(os.environ.get("PDSERVE_RDMA_EMU_DROP_COMPLETIONS", "0") or 0),
        )

    def take_drop(self) -> bool:
        if self.drop_completions > 0:
            self.drop_completions -= 1
            return True
        return False


class Fabric:
    """QPs by number and MRs/MWs by rkey, for every emulated context in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._qps: dict[int, object] = {}
        self._keys: dict[int, object] = {}
        self._next_qpn = 0x40
        self.faults = FaultHooks.from_env()
        self._endpoint = None

    def endpoint(self):
        """This device's wire endpoint (`verbs_emu.wire.DeviceEndpoint`), started on first use."""
        with self._lock:
            if self._endpoint is None:
                from pdserve.cachestore.verbs_emu.wire import DeviceEndpoint

                self._endpoint = DeviceEndpoint(self)
            return self._endpoint

    def add_qp(self, qp) -> int:
        with self._lock:
            self._next_qpn += 1
            self._qps[self._next_qpn] = qp
            return self._next_qpn

    def remove_qp(self, qp_num: int) -> None:
        with self._lock:
            self._qps.pop(qp_num, None)

    def qp(self, qp_num: int):
        with self._lock:
            return self._qps.get(qp_num)

    def register_key(self, key: int, owner) -> None:
        with self._lock:
            self._keys[key] = owner

    def unregister_key(self, key: int) -> None:
        with self._lock:
            self._keys.pop(key, None)

    def key(self, key: int):
        with self._lock:
            return self._keys.get(key)


FABRIC = Fabric()


class Device:
    """What get_device_list() returns: a name."""

    def __init__(self, name: str) -> None:
        self.name = name.encode()


def get_device_list() -> list[Device]:
    return [Device(DEVICE_NAME)]


class PortAttr:
    """query_port(): the emulated port is RoCE-like (Ethernet link layer, RoCE v2 GID) with an
    active MTU of 1024 bytes, so code that hard-codes a path MTU instead of asking the port is
    refused at RTR (a QP's path MTU cannot exceed its port's active MTU)."""

    def __init__(self, lid: int) -> None:
        self.lid = lid
        self.state = enums.IBV_PORT_ACTIVE
        self.active_mtu = enums.IBV_MTU_1024
        self.max_mtu = enums.IBV_MTU_4096
        self.link_layer = enums.IBV_LINK_LAYER_ETHERNET
        self.gid_tbl_len = 1


class Context:
    """An opened device: the fabric it is attached to, port 1, GID index 0 only."""

    def __init__(self, name: str = DEVICE_NAME, fabric: Fabric | None = None) -> None:
        if name != DEVICE_NAME:
            raise OSError(f"no RDMA device named {name!r} (emulated device: {DEVICE_NAME})")
        self.name = name
        self.fabric = fabric or FABRIC

    def query_port(self, port: int) -> PortAttr:
        if port != 1:
            raise OSError(f"port {port} does not exist on {self.name}")
        return PortAttr(lid=1)

    def query_gid(self, port: int, index: int) -> GID:
        """GID index 0 of port 1 (a pyverbs GID): it names this process's device endpoint
        (`verbs_emu.wire.make_gid`)."""
        self._check_gid(port, index)
        return GID(self.fabric.endpoint().gid)

    def query_gid_type(self, port: int, index: int) -> int:
        self._check_gid(port, index)
        return enums.IBV_GID_TYPE_ROCE_V2

    def _check_gid(self, port: int, index: int) -> None:
        if port != 1 or index != 0:
            raise OSError(f"no GID at port {port} index {index} on {self.name}")
