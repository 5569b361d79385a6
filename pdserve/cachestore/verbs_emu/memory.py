"""Protection domains, memory regions and type-2 memory windows of the emulated device.

Rules taken from the verbs specification (IBTA vol. 1, ch. 10.6 and 11.2.8, and ibv_reg_mr(3),
ibv_alloc_mw(3), ibv_bind_mw(3)):
  * REMOTE_WRITE (or REMOTE_ATOMIC) access requires LOCAL_WRITE at registration, else EINVAL.
  * A type-2 window is allocated unbound: its rkey grants nothing until a BIND_MW work request binds
    it to a range of an MR registered with MW_BIND, on a QP of the same PD. The bound window is
    associated with that QP: remote access through any other QP is refused.
  * A type-2 bind gives the window the rkey the BIND_MW work request carries (pyverbs computes it in
    set_bind_wr: the window's key index with a new 8-bit key; read it back as `wr.rkey`). The MW
    object's own `rkey` stays the allocation key, which grants nothing: code that reads the window's
    key from the MW instead of the WR holds a dead key, as on hardware. A bound window must be
    invalidated (LOCAL_INV of its current key) before it is bound again.
  * Invalidation, deallocation and deregistration complete only after a remote access in progress
    through the key has finished (each MR/MW has a lock held across check-and-copy), so once they
    return no byte can land through that key.
"""

from __future__ import annotations

import itertools
import threading

from pdserve.cachestore.verbs_emu import enums


class VerbsError(OSError):
    """A verb call refused synchronously (what pyverbs raises as PyverbsRDMAError)."""


_keys = itertools.count(0x100)
_lock = threading.Lock()


def new_key_index() -> int:
    """A fresh key index: the top 24 bits of an lkey/rkey (the low 8 bits are the consumer key)."""
    with _lock:
        return next(_keys)


class PD:
    """A protection domain: MRs, MWs and QPs of one PD may be used together, never across PDs."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx


class MR:
    """Registered memory [address, address+length) with access flags; lkey and rkey name it."""

    def __init__(self, pd: PD, length: int, access: int, address: int) -> None:
        if (
            access & (enums.IBV_ACCESS_REMOTE_WRITE | enums.IBV_ACCESS_REMOTE_ATOMIC)
            and not access & enums.IBV_ACCESS_LOCAL_WRITE
        ):
            raise VerbsError("ibv_reg_mr: REMOTE_WRITE requires LOCAL_WRITE (EINVAL)")
        if length <= 0 or not address:
            raise VerbsError("ibv_reg_mr: empty or unmapped range (EINVAL)")
        self.pd, self.address, self.length, self.access = pd, address, length, access
        self.lkey = self.rkey = new_key_index() << 8
        self.valid = True
        self.lock = threading.RLock()
        pd.ctx.fabric.register_key(self.rkey, self)

    def covers(self, address: int, length: int) -> bool:
        return self.address <= address and address + length <= self.address + self.length

    def close(self) -> None:
        """ibv_dereg_mr: the keys stop working once an access in progress has finished."""
        with self.lock:
            self.valid = False
            self.pd.ctx.fabric.unregister_key(self.rkey)


class MWBindInfo:
    """What a BIND_MW work request grants: `length` bytes of `mr` from `addr`, with `mw_access_flags`."""

    def __init__(self, mr: MR, addr: int, length: int, mw_access_flags: int) -> None:
        self.mr, self.addr, self.length, self.mw_access_flags = mr, addr, length, mw_access_flags


class MW:
    """A type-2 memory window: unbound until a BIND_MW WR on a QP binds it (see the module docstring)."""

    def __init__(self, pd: PD, mw_type: int) -> None:
        if mw_type != enums.IBV_MW_TYPE_2:
            raise VerbsError("this emulated device supports type-2 memory windows only")
        self.pd = pd
        self.rkey = new_key_index() << 8
        """The allocation key (ibv_alloc_mw); a bind's key comes from its work request."""
        self.bound_rkey: int | None = None
        self.bound: MWBindInfo | None = None
        self.lock = threading.RLock()
        self.qp = None
        """The QP the window is bound through (type 2: only that QP may use it)."""

    def bind(self, qp, info: MWBindInfo, rkey: int) -> int:
        """Executed by the QP's send engine for a BIND_MW WR carrying `rkey`; returns a wc status."""
        mr = info.mr
        if (
            self.bound is not None
            or rkey >> 8 != self.rkey >> 8
            or rkey == self.rkey
            or not mr.valid
            or mr.pd is not self.pd
            or qp.pd is not self.pd
            or not mr.access & enums.IBV_ACCESS_MW_BIND
            or not mr.covers(info.addr, info.length)
            or (info.mw_access_flags & enums.IBV_ACCESS_REMOTE_WRITE and not mr.access & enums.IBV_ACCESS_LOCAL_WRITE)
        ):
            return enums.IBV_WC_MW_BIND_ERR
        with self.lock:
            self.bound, self.qp, self.bound_rkey = info, qp, rkey
            self.pd.ctx.fabric.register_key(rkey, self)
        return enums.IBV_WC_SUCCESS

    def invalidate(self, rkey: int) -> int:
        """LOCAL_INV of `rkey`: it must be the window's current key; then it grants nothing."""
        with self.lock:
            if self.bound is None or rkey != self.bound_rkey:
                return enums.IBV_WC_LOC_PROT_ERR
            self._unbind()
        return enums.IBV_WC_SUCCESS

    def _unbind(self) -> None:
        if self.bound_rkey is not None:
            self.pd.ctx.fabric.unregister_key(self.bound_rkey)
        self.bound = self.qp = self.bound_rkey = None

    def close(self) -> None:
        """ibv_dealloc_mw: a bound window is invalidated too."""
        with self.lock:
            self._unbind()


def remote_target(key_owner, responder_qp, address: int, length: int, access: int) -> bool:
    """True if `key_owner` (MR or MW found by rkey) lets `responder_qp` access the range with `access`."""
    if isinstance(key_owner, MR):
        return (
            key_owner.valid
            and key_owner.pd is responder_qp.pd
            and key_owner.access & access == access
            and key_owner.covers(address, length)
        )
    if isinstance(key_owner, MW):
        b = key_owner.bound
        return (
            b is not None
            and key_owner.qp is responder_qp
            and b.mr.valid
            and b.mw_access_flags & access == access
            and b.addr <= address
            and address + length <= b.addr + b.length
        )
    return False
