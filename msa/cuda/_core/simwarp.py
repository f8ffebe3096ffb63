"""Warp-level intrinsics for Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``).

The simulator runs every CUDA thread as a Python thread but has none of the warp operations, so a
kernel that shuffles cannot run in CI. ``install()`` adds them to the simulator's fake ``cuda``
module with the semantics of the real ones (CUDA programming guide, PTX ``shfl.sync``/``vote.sync``)
and the signatures of ``numba.cuda``, so that one kernel source runs on the GPU and here::

    cuda.shfl_sync(mask, value, src_lane)      cuda.ballot_sync(mask, predicate)  -> int32
    cuda.shfl_up_sync(mask, value, delta)      cuda.all_sync / any_sync / eq_sync -> bool
    cuda.shfl_down_sync(mask, value, delta)    cuda.match_any_sync(mask, value)   -> int32
    cuda.shfl_xor_sync(mask, value, lane_mask) cuda.match_all_sync(mask, value)   -> (int32, bool)
    cuda.syncwarp(mask=0xFFFFFFFF)             cuda.activemask(), cuda.lanemask_lt() -> uint32

Semantics, as on the GPU:

* A warp is 32 consecutive linear thread ids of a block (``x + Dx*(y + Dy*z)``); the last warp of
  a block whose size is not a multiple of 32 is partial, and its missing lanes count as exited.
* Every calling lane must have its own bit in ``mask``, and every non-exited lane named in
  ``mask`` must reach a warp operation of the same kind with the same mask (any call site, as on
  Volta and later). Lanes that have exited are left out.
* Shuffles read ``value`` from lane ``j``: ``src_lane & 31`` (``shfl_sync``), ``lane - delta``
  (``shfl_up_sync``; a lane whose ``j < 0`` keeps its own value), ``lane + delta``
  (``shfl_down_sync``; ``j > 31`` keeps its own value), ``lane ^ lane_mask`` (``shfl_xor_sync``).
  Only the low 5 bits of ``src_lane``/``delta``/``lane_mask`` count (PTX). Numba's API has no
  ``width`` argument; the segment is the whole warp. ``value`` must be a 32- or 64-bit int or
  float, as Numba requires; the result has the caller's type.
* Reading a lane that does not take part (outside ``mask``, exited, or past the end of a partial
  warp) is undefined on the GPU. Here it returns a poison value (NaN for floats, the most negative
  integer for ints) so that a kernel relying on it fails its test; ``strict=True`` (or
  ``MSA_SIMWARP_STRICT=1``) raises ``WarpUsageError`` instead.
* ``ballot_sync``/``match_*_sync`` return int32 and ``activemask``/``lanemask_lt`` uint32, as
  NumPy scalars that, like Numba, promote to int64 when combined with a Python int literal
  (``ballot & (1 << 31)`` works); ``cuda.popc/clz/ffs/brev`` are made width-aware so that
  ``popc(ballot)`` counts 32 bits of an int32 ``-1``.
* ``activemask()`` has no notion of divergence to read: it returns the lanes that reach an
  ``activemask()`` together, leaving out lanes that have exited, wait in ``syncthreads`` or wait
  in another warp operation. After ``if i >= n: return`` it gives exactly the lanes ``< n``.

Errors instead of hangs: if a lane named in the mask waits in ``syncthreads`` (a certain
deadlock), or does not arrive within ``timeout`` seconds (default 60, ``MSA_SIMWARP_TIMEOUT``),
the waiting lanes raise ``WarpDeadlockError`` naming the operation, the mask, the block, the warp,
and which lanes arrived and which did not. Mismatched masks or operations raise ``WarpUsageError``.

IEEE ``math`` in kernels: Python's ``math.log(0)``, ``math.sqrt(-1)`` or ``math.exp(1000)``
raise where CUDA returns ``-inf``, NaN or ``inf``, so a kernel given non-finite data (valid
input: an ``inf`` key) would fail here and not on the GPU. While a kernel runs, the ``math`` of
its module is ``IEEE_MATH``: ``math``'s functions, with the ones that raise answering as
NumPy's float64 ufuncs do instead (``ieee_math``).

Uninitialised shared memory: a GPU block finds what the SM's last block left there, the
simulator zeros (then the previous block's values). ``MSA_SIM_POISON_SHARED=1`` (or
``install(poison_shared=True)``) starts every block's shared memory as 0xFF bytes (NaN floats,
-1 ints), so that a read of shared memory the block never wrote shows in its results.

``install()`` is idempotent and a no-op (returning False) outside the simulator. Kernels without
warp operations are unaffected apart from a per-block bookkeeping step at thread start and exit,
and every kernel gets the simulator's block loop with two mends (``_block_manager_run``): it
hands the GIL over each round (about ten times faster) and reports the first exception reliably.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time

import numpy as np

WARP_SIZE = 32
FULL_MASK = 0xFFFFFFFF
_STUCK_GRACE_S = 5.0  # how long a lane must stay in syncthreads to count as a deadlock
_POLL_S = 0.02  # how often a waiting lane re-checks for exits, syncthreads and aborts

_settings = {
    "timeout": float(os.environ.get("MSA_SIMWARP_TIMEOUT", "60")),
    "strict": os.environ.get("MSA_SIMWARP_STRICT", "0") == "1",
    "poison_shared": os.environ.get("MSA_SIM_POISON_SHARED", "0") == "1",
}
_POISON_BYTE = 0xFF  # every float a NaN (bf16, fp16, fp32, fp64), every int -1
_install_lock = threading.Lock()
_state_lock = threading.Lock()
_installed = False

_SHFL_DTYPES = frozenset(np.dtype(t) for t in (np.int32, np.int64, np.float32, np.float64))


class WarpDeadlockError(RuntimeError):
    """Lanes named in a warp operation's mask can never (or did not in time) arrive."""


class WarpUsageError(RuntimeError):
    """A warp operation used in a way that is undefined on the GPU (mask, mismatch, bad read)."""


# -- int32/uint32 results that combine with literals the way Numba types them -------------------

def _promoting_int(base, name):
    """A subclass of NumPy scalar ``base`` whose arithmetic with a Python int is done in int64.

    Numba types an integer literal as int64, so on the GPU ``ballot & (1 << 31)`` is an int64
    operation; NumPy would instead try to fit ``1 << 31`` into int32 and raise OverflowError.
    """
    ns = {"__slots__": (), "__doc__": f"{base.__name__} result of a simulated warp operation."}
    for op in ("add", "sub", "mul", "floordiv", "mod", "and", "or", "xor", "lshift", "rshift"):
        for meth in (f"__{op}__", f"__r{op}__"):
            def f(self, other, _meth=meth):
                if type(other) in (int, bool):
                    return getattr(np.int64(self), _meth)(other)
                return getattr(base, _meth)(self, other)
            f.__name__ = meth
            ns[meth] = f
    return type(name, (base,), ns)


_Int32 = _promoting_int(np.int32, "_Int32")
_UInt32 = _promoting_int(np.uint32, "_UInt32")


def _as_int32(bits: int):
    return _Int32(bits - (1 << 32) if bits >= (1 << 31) else bits)


# -- per-block bookkeeping ----------------------------------------------------------------------

class _Warp:
    """Rendezvous state of one warp: what each lane waits in, and the results handed back."""

    def __init__(self, index: int, num_lanes: int):
        self.index = index
        self.existing = (1 << num_lanes) - 1  # lanes past the end of a partial warp never exist
        self.cond = threading.Condition(threading.Lock())
        self.threads = [None] * WARP_SIZE  # BlockThread of each lane, once started
        self.pending = [None] * WARP_SIZE  # (kind, name, mask, payload) while a lane waits
        self.results = [None] * WARP_SIZE  # (participants, payloads) handed to a waiting lane
        self.exited = 0  # bit mask of lanes whose thread has finished


class _BlockWarps:
    def __init__(self, block_dim):
        n = int(np.prod(block_dim))
        self.warps = [_Warp(w, min(WARP_SIZE, n - w * WARP_SIZE))
                      for w in range(-(-n // WARP_SIZE))]


def _block_state(manager) -> _BlockWarps:
    state = manager.__dict__.get("_msa_simwarp")
    if state is None:
        with _state_lock:
            state = manager.__dict__.get("_msa_simwarp")
            if state is None:
                state = _BlockWarps(manager._block_dim)
                manager._msa_simwarp = state
    return state


def _current():
    """``(thread, warp, lane)`` of the simulated CUDA thread running this code."""
    t = threading.current_thread()
    manager = getattr(t, "_manager", None)
    if manager is None:
        raise RuntimeError("a warp operation was called outside a simulated CUDA kernel")
    tid = t.thread_id
    return t, _block_state(manager).warps[tid // WARP_SIZE], tid % WARP_SIZE


def _wrap_thread_run(orig_run):
    """BlockThread.run that records when a lane starts and exits (exited lanes leave warp ops)."""

    def run(self):
        warp = _block_state(self._manager).warps[self.thread_id // WARP_SIZE]
        lane = self.thread_id % WARP_SIZE
        with warp.cond:
            warp.threads[lane] = self
        try:
            orig_run(self)
        finally:
            with warp.cond:
                warp.exited |= 1 << lane
                warp.cond.notify_all()

    run._msa_simwarp = True
    return run



def _block_manager_run(self, grid_point, *args):
    """``BlockManager.run`` of Numba's simulator (numba-cuda 0.30), with three changes.

    The simulator runs a block as one Python thread per CUDA thread and a manager loop that
    polls them for ``syncthreads`` and exceptions. Its loop never waits, so it holds the GIL for
    most of every switch interval while the block's threads wait their turn; ``time.sleep(0)``
    each round hands the GIL over and makes kernels about ten times faster in the simulator
    (measured on K1, K2 and the CSR kernels).

    It also checks a thread that has ended for an exception before dropping it. The original
    checks ``thread.exception`` in one pass and drops the ended threads in the next statement: a
    thread that fails and ends between the two was only found by the final check, after every
    other thread had ended, which reports whichever failed thread a set yields first (seen in CI:
    a deadlock error replaced by a late lane's failure on poison, 10 s later).

    And it lowers every thread's ``syncthreads_blocked`` flag before it wakes any of them. The
    original lowers one flag, wakes that thread, then goes to the next: a woken lane that got the
    GIL first saw siblings still "in syncthreads", so ``activemask()`` left them out and a
    full-mask operation took them for a deadlock (seen in CI on a loaded machine).
    """
    from numba.cuda.simulator.kernel import BlockThread, _get_kernel_context

    if _settings["poison_shared"]:  # the block's shared memory so far (dynamic, static) as poison
        shared = _get_kernel_context()._shared
        for arr in (shared._dynshared, *shared._allocations.values()):
            arr.view(np.uint8)[...] = _POISON_BYTE
    threads = []
    for block_point in np.ndindex(*self._block_dim):
        def target():
            self._f(*args)

        t = BlockThread(target, self, grid_point, block_point, self._debug)
        t.start()
        threads.append(t)

    def fail(t):
        for other in threads:  # abort the others; they are not joined (as in the simulator)
            other.abort = True
            other.syncthreads_blocked = False
            other.syncthreads_event.set()
        raise t.exception[0].with_traceback(t.exception[1])

    live = list(threads)
    blocked = set()
    while live:
        for t in live:
            if t.syncthreads_blocked:
                blocked.add(t)
            elif t.exception:
                fail(t)
        if len(blocked) == len(live):  # every live thread waits in syncthreads: release them
            # Every flag goes down before the first thread wakes: a woken thread that reaches a
            # warp operation must not see a sibling still marked as waiting in this barrier.
            for t in blocked:
                t.syncthreads_blocked = False
            for t in blocked:
                t.syncthreads_event.set()
            blocked = set()
        still = []
        for t in live:
            if t.is_alive():
                still.append(t)
            elif t.exception:
                fail(t)
        live = still
        time.sleep(0)
    for t in threads:
        if t.exception:
            fail(t)


_block_manager_run._msa_simwarp = True


def _manager_run_fits(kernel) -> bool:
    """Whether this simulator is the one ``_block_manager_run`` copies: block threads made with
    the same arguments, a manager with the fields it reads, and a ``run`` that is still the
    poll-syncthreads-and-exceptions loop (otherwise its own ``BlockManager.run`` is kept:
    slower, not wrong)."""
    import inspect

    try:
        thread_params = list(inspect.signature(kernel.BlockThread.__init__).parameters)
        manager_params = list(inspect.signature(kernel.BlockManager.__init__).parameters)
        run_source = inspect.getsource(kernel.BlockManager.run)
        init_source = inspect.getsource(kernel.BlockManager.__init__)
    except (TypeError, OSError, ValueError):
        return False
    return (thread_params == ["self", "f", "manager", "blockIdx", "threadIdx", "debug"]
            and manager_params == ["self", "f", "grid_dim", "block_dim", "debug"]
            and all(f"self.{name} =" in init_source for name in ("_f", "_block_dim", "_debug"))
            and all(token in run_source for token in (
                "syncthreads_blocked", "syncthreads_event.set()", "t.exception", "is_alive()",
                "abort = True")))


# -- the rendezvous -----------------------------------------------------------------------------

def _lanes(bits: int) -> str:
    """``0b1111_0000_0001`` -> ``'0, 8-11'``."""
    out, lane = [], 0
    while lane < WARP_SIZE:
        if bits >> lane & 1:
            end = lane
            while end + 1 < WARP_SIZE and bits >> (end + 1) & 1:
                end += 1
            out.append(str(lane) if end == lane else f"{lane}-{end}")
            lane = end + 1
        else:
            lane += 1
    return ", ".join(out) if out else "none"


def _where(t, warp) -> str:
    return f"warp {warp.index} (threads {warp.index * WARP_SIZE}..) of block {tuple(t.blockIdx)}"


def _missing_state(warp, lane) -> str:
    th = warp.threads[lane]
    if warp.pending[lane] is not None:
        return f"in cuda.{warp.pending[lane][1]}(mask={warp.pending[lane][2]:#010x})"
    if th is None:
        return "not started yet"
    if th.syncthreads_blocked:
        return "in cuda.syncthreads()"
    return "running"


def _try_complete(warp, lane) -> bool:
    """Complete the operation ``lane`` waits in if every lane it needs is there (lock held)."""
    kind, name, mask, _ = warp.pending[lane]
    needed = mask & warp.existing & ~warp.exited
    group = 0
    for other in range(WARP_SIZE):
        if not needed >> other & 1:
            continue
        entry = warp.pending[other]
        th = warp.threads[other]
        if entry is not None and entry[0] == kind:
            if entry[2] != mask:
                raise WarpUsageError(
                    f"cuda.{name}(mask={mask:#010x}) in lane {lane} meets cuda.{entry[1]}"
                    f"(mask={entry[2]:#010x}) in lane {other}: lanes named in a mask must all use "
                    f"the same mask")
            group |= 1 << other
        elif kind == "activemask" and (entry is not None
                                       or (th is not None and th.syncthreads_blocked)):
            continue  # a lane waiting elsewhere is not converged with this one
        elif entry is not None and kind != "activemask" and entry[0] != "activemask":
            raise WarpUsageError(
                f"cuda.{name}(mask={mask:#010x}) in lane {lane} meets cuda.{entry[1]}"
                f"(mask={entry[2]:#010x}) in lane {other}: every lane named in a mask must reach "
                f"the same kind of warp operation")
        else:
            return False
    payloads = [None] * WARP_SIZE
    for other in range(WARP_SIZE):
        if group >> other & 1:
            payloads[other] = warp.pending[other][3]
    result = (group, payloads)
    for other in range(WARP_SIZE):
        if group >> other & 1:
            warp.pending[other] = None
            warp.results[other] = result
    warp.cond.notify_all()
    return True


def _check_deadlock(t, warp, lane, stuck_since):
    """Raise if a lane this operation needs waits in syncthreads, which cannot finish first.

    Numba's own block loop releases a syncthreads barrier one thread at a time, so a sibling can
    still look blocked for a moment after this lane left the same barrier (the loop ``install()``
    puts in place does not, but it is kept only where it fits): only a state that lasts
    ``_STUCK_GRACE_S`` counts. Returns the time the current stuck state was first seen (or None).
    """
    kind, name, mask, _ = warp.pending[lane]
    needed = mask & warp.existing & ~warp.exited
    stuck = 0
    for other in range(WARP_SIZE):
        th = warp.threads[other]
        if needed >> other & 1 and warp.pending[other] is None and th is not None \
                and th.syncthreads_blocked:
            stuck |= 1 << other
    if not stuck:
        return None
    now = time.monotonic()
    if stuck_since is None or now - stuck_since < _STUCK_GRACE_S:
        return stuck_since if stuck_since is not None else now
    if stuck:
        missing = needed & ~sum(1 << o for o in range(WARP_SIZE) if warp.pending[o] is not None
                                and warp.pending[o][0] == kind)
        raise WarpDeadlockError(
            f"deadlock: cuda.{name}(mask={mask:#010x}) in {_where(t, warp)} needs lanes "
            f"{_lanes(missing)}, which have not arrived, and lanes {_lanes(stuck)} of them wait in "
            f"cuda.syncthreads(), which cannot finish while this warp waits. Every non-exited lane "
            f"named in the mask must call the warp operation; after a divergent branch use a "
            f"narrower mask or cuda.activemask().")


def _collective(kind: str, name: str, mask: int, payload, where=None):
    """Wait until the lanes of ``mask`` meet; return ``(participants bit mask, payloads[32])``."""
    t, warp, lane = where or _current()
    if not mask >> lane & 1:
        raise WarpUsageError(
            f"cuda.{name}(mask={mask:#010x}) called by lane {lane}, whose own bit is not in the "
            f"mask (undefined on the GPU)")
    deadline = time.monotonic() + _settings["timeout"]
    stuck_since = None
    with warp.cond:
        warp.pending[lane] = (kind, name, mask, payload)
        # On an error the entry stays: the block is aborted, and later messages still count
        # this lane as arrived.
        while warp.results[lane] is None:
            if t.abort:
                raise RuntimeError(f"cuda.{name} aborted: another simulated thread failed")
            if _try_complete(warp, lane):
                break
            if kind != "activemask":
                stuck_since = _check_deadlock(t, warp, lane, stuck_since)
            if time.monotonic() > deadline:
                needed = mask & warp.existing & ~warp.exited
                arrived = sum(1 << o for o in range(WARP_SIZE)
                              if warp.pending[o] is not None and warp.pending[o][0] == kind)
                missing = needed & ~arrived
                by_state = {}
                for o in range(WARP_SIZE):
                    if missing >> o & 1:
                        state = _missing_state(warp, o)
                        by_state[state] = by_state.get(state, 0) | 1 << o
                states = "; ".join(f"lanes {_lanes(b)}: {st}" for st, b in by_state.items())
                raise WarpDeadlockError(
                    f"cuda.{name}(mask={mask:#010x}) in {_where(t, warp)}: lanes "
                    f"{_lanes(missing)} named in the mask did not arrive within "
                    f"{_settings['timeout']:g} s (lanes {_lanes(arrived)} waited; {states}). "
                    f"Every non-exited lane named in the mask must reach the warp operation; "
                    f"a full mask needs the whole warp, so after a divergent branch use a "
                    f"narrower mask or cuda.activemask().")
            warp.cond.wait(_POLL_S)
        result = warp.results[lane]
        warp.results[lane] = None
    return result


# -- argument checks mirroring Numba's typing ---------------------------------------------------

def _check_mask(name, mask) -> int:
    if isinstance(mask, (bool, np.bool_)) or not isinstance(mask, (int, np.integer)):
        raise TypeError(f"cuda.{name}: mask must be an integer, got {type(mask).__name__} {mask!r}")
    return int(mask) & FULL_MASK


def _check_lane_arg(name, arg_name, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"cuda.{name}: {arg_name} must be an integer, got {type(value).__name__}")
    return int(value) & (WARP_SIZE - 1)


def _check_value(name, value):
    if isinstance(value, (bool, np.bool_)):
        ok = False
    elif isinstance(value, (int, float)) and not isinstance(value, np.generic):
        ok = True
    else:
        ok = isinstance(value, np.generic) and value.dtype in _SHFL_DTYPES
    if not ok:
        raise TypeError(
            f"cuda.{name} only supports 32- and 64-bit ints and floats (as on the GPU), got "
            f"{type(value).__name__} {value!r}")


def _check_predicate(name, predicate) -> bool:
    if not isinstance(predicate, (bool, int, np.bool_, np.integer)):
        raise TypeError(f"cuda.{name}: predicate must be an integer or boolean, got "
                        f"{type(predicate).__name__} {predicate!r}")
    return bool(predicate)


def _poison(name, value, src, lane, group):
    if _settings["strict"]:
        raise WarpUsageError(
            f"cuda.{name}: lane {lane} reads lane {src}, which does not take part (participants: "
            f"lanes {_lanes(group)}); the value is undefined on the GPU")
    if isinstance(value, (float, np.floating)):
        return type(value)(np.nan)
    if isinstance(value, np.integer):
        return type(value)(np.iinfo(value.dtype).min)
    return -(1 << 63)


# -- the intrinsics -----------------------------------------------------------------------------

def _shuffle(name, mask, value, src_of_lane):
    mask = _check_mask(name, mask)
    _check_value(name, value)
    where = _current()
    lane = where[2]
    src = src_of_lane(lane)
    group, payloads = _collective("shfl", name, mask, value, where)
    if src == lane:
        return value
    if not group >> src & 1:
        return _poison(name, value, src, lane, group)
    return type(value)(payloads[src])


def shfl_sync(mask, value, src_lane):
    """``value`` of lane ``src_lane & 31``."""
    b = _check_lane_arg("shfl_sync", "src_lane", src_lane)
    return _shuffle("shfl_sync", mask, value, lambda lane: b)


def shfl_up_sync(mask, value, delta):
    """``value`` of lane ``lane - delta``; lanes with ``lane < delta`` keep their own."""
    b = _check_lane_arg("shfl_up_sync", "delta", delta)
    return _shuffle("shfl_up_sync", mask, value, lambda lane: lane - b if lane >= b else lane)


def shfl_down_sync(mask, value, delta):
    """``value`` of lane ``lane + delta``; lanes with ``lane + delta > 31`` keep their own."""
    b = _check_lane_arg("shfl_down_sync", "delta", delta)
    return _shuffle("shfl_down_sync", mask, value,
                    lambda lane: lane + b if lane + b < WARP_SIZE else lane)


def shfl_xor_sync(mask, value, lane_mask):
    """``value`` of lane ``lane ^ lane_mask``."""
    b = _check_lane_arg("shfl_xor_sync", "lane_mask", lane_mask)
    return _shuffle("shfl_xor_sync", mask, value, lambda lane: lane ^ b)


def _vote(name, mask, predicate):
    mask = _check_mask(name, mask)
    pred = _check_predicate(name, predicate)
    group, payloads = _collective("vote", name, mask, pred)
    return sum(1 << o for o in range(WARP_SIZE) if group >> o & 1 and payloads[o]), group


def ballot_sync(mask, predicate):
    """int32 bit mask of the participating lanes whose predicate is true."""
    return _as_int32(_vote("ballot_sync", mask, predicate)[0])


def all_sync(mask, predicate):
    """True iff the predicate is true in every participating lane."""
    ballot, group = _vote("all_sync", mask, predicate)
    return ballot == group


def any_sync(mask, predicate):
    """True iff the predicate is true in some participating lane."""
    return _vote("any_sync", mask, predicate)[0] != 0


def eq_sync(mask, predicate):
    """True iff the predicate is the same in every participating lane."""
    ballot, group = _vote("eq_sync", mask, predicate)
    return ballot == 0 or ballot == group


def _bits_of(value):
    """The bit pattern the GPU compares (floats by their bits, so NaN can match NaN)."""
    if isinstance(value, np.generic):
        return value.dtype.itemsize, int(np.asarray(value).view(f"u{value.dtype.itemsize}"))
    if isinstance(value, float):
        return 8, int(np.asarray(value, np.float64).view(np.uint64))
    return 8, int(value) & ((1 << 64) - 1)


def _match(name, mask, value):
    mask = _check_mask(name, mask)
    _check_value(name, value)
    where = _current()
    lane = where[2]
    group, payloads = _collective("match", name, mask, _bits_of(value), where)
    same = sum(1 << o for o in range(WARP_SIZE) if group >> o & 1 and payloads[o] == payloads[lane])
    return same, group


def match_any_sync(mask, value):
    """int32 mask of the participating lanes whose ``value`` has the same bits as this lane's."""
    return _as_int32(_match("match_any_sync", mask, value)[0])


def match_all_sync(mask, value):
    """``(mask, True)`` if every participating lane has the same ``value``, else ``(0, False)``."""
    same, group = _match("match_all_sync", mask, value)
    return (_as_int32(group), True) if same == group else (_as_int32(0), False)


def exchange(payload):
    """Every lane's ``payload``: a list of 32 (``None`` for a lane past the end of a partial
    warp or exited), after one rendezvous of the calling warp's lanes.

    Not a CUDA intrinsic: the simulator twins of warp-wide instructions (``mma.sync``,
    ``ldmatrix``), which read other lanes' registers, gather them with it in one meeting instead
    of a shuffle per register or a ``syncthreads`` of the whole block."""
    return _collective("exchange", "exchange", FULL_MASK, payload)[1]


def syncwarp(mask=FULL_MASK):
    """Wait until every non-exited lane named in ``mask`` reaches a ``syncwarp`` with that mask."""
    _collective("sync", "syncwarp", _check_mask("syncwarp", mask), None)


def activemask():
    """uint32 mask of the lanes that reach ``activemask()`` together (see the module docstring)."""
    where = _current()
    group, _ = _collective("activemask", "activemask", where[1].existing, None, where)
    return _UInt32(group)


def lanemask_lt():
    """uint32 mask of the lanes below this one."""
    return _UInt32((1 << _current()[2]) - 1)


# -- width-aware bit intrinsics (the simulator's treat a negative int as '-0b...') -------------

def _width_and_bits(value):
    if isinstance(value, np.integer):
        width = value.dtype.itemsize * 8
    else:
        width = 32 if -(1 << 31) <= int(value) < (1 << 32) else 64
    return width, int(value) & ((1 << width) - 1)


def popc(value):
    """Number of set bits in ``value``'s width (an int32 ``-1`` has 32)."""
    return bin(_width_and_bits(value)[1]).count("1")


def clz(value):
    """Number of leading zero bits in ``value``'s width."""
    width, bits = _width_and_bits(value)
    return width - bits.bit_length()


def ffs(value):
    """1-based position of the least significant set bit, 0 if none."""
    bits = _width_and_bits(value)[1]
    return (bits & -bits).bit_length()


def brev(value):
    """``value``'s bits reversed in its width."""
    width, bits = _width_and_bits(value)
    return int(format(bits, f"0{width}b")[::-1], 2)


_INTRINSICS = {
    "shfl_sync": shfl_sync, "shfl_up_sync": shfl_up_sync, "shfl_down_sync": shfl_down_sync,
    "shfl_xor_sync": shfl_xor_sync, "ballot_sync": ballot_sync, "all_sync": all_sync,
    "any_sync": any_sync, "eq_sync": eq_sync, "match_any_sync": match_any_sync,
    "match_all_sync": match_all_sync, "syncwarp": syncwarp, "activemask": activemask,
    "lanemask_lt": lanemask_lt,
}
_BIT_INTRINSICS = {"popc": popc, "clz": clz, "ffs": ffs, "brev": brev}


def simulator_enabled() -> bool:
    from numba.cuda.core import config

    return bool(config.ENABLE_CUDASIM)


# --- IEEE math in kernels ---------------------------------------------------------------------

def _ieee(fn, ufunc):
    """``fn`` (a ``math`` function), with ``ufunc``'s float64 result where ``fn`` raises."""
    def ieee(*args):
        try:
            return fn(*args)
        except (ValueError, OverflowError):  # a domain or range error: what CUDA returns
            with np.errstate(all="ignore"):
                return float(ufunc(*(np.float64(a) for a in args)))
    ieee.__name__ = fn.__name__
    return ieee


class _IEEEMath:
    """``math`` for kernels in the simulator: CUDA's ``inf``/NaN where Python's raise."""

    def __getattr__(self, name):
        return getattr(math, name)


_UFUNCS = {"log": np.log, "log2": np.log2, "log10": np.log10, "log1p": np.log1p,
           "sqrt": np.sqrt, "exp": np.exp, "exp2": np.exp2, "expm1": np.expm1,
           "pow": np.power, "cosh": np.cosh, "sinh": np.sinh, "acos": np.arccos,
           "asin": np.arcsin, "acosh": np.arccosh, "atanh": np.arctanh, "fmod": np.fmod}
for _name, _ufunc in _UFUNCS.items():
    if hasattr(math, _name):
        setattr(_IEEEMath, _name, staticmethod(_ieee(getattr(math, _name), _ufunc)))
IEEE_MATH = _IEEEMath()

_math_lock = threading.Lock()
_math_users: dict = {}  # id(globals) -> [kernels running, the names swapped]


def _swapping_math(original):
    """Numba's ``swapped_cuda_module`` that also makes a kernel module's ``math`` IEEE_MATH
    while any of its kernels runs (reference-counted per module, as Numba does for ``cuda``)."""
    @contextlib.contextmanager
    def swapped(fn, fake_cuda_module):
        globs = fn.__globals__
        with _math_lock:
            entry = _math_users.get(id(globs))
            if entry is None:
                names = [k for k, v in globs.items() if v is math]
                for k in names:
                    globs[k] = IEEE_MATH
                entry = _math_users[id(globs)] = [0, names]
            entry[0] += 1
        try:
            with original(fn, fake_cuda_module):
                yield
        finally:
            with _math_lock:
                entry[0] -= 1
                if entry[0] == 0:
                    for k in entry[1]:
                        globs[k] = math
                    del _math_users[id(globs)]
    swapped._msa_simwarp = True
    return swapped


def install(*, timeout: float | None = None, strict: bool | None = None,
            poison_shared: bool | None = None) -> bool:
    """Add the warp operations to Numba's simulator; returns whether the simulator is in use.

    Idempotent. ``timeout`` (seconds a lane waits for the rest of its mask before raising
    ``WarpDeadlockError``), ``strict`` (raise instead of returning poison on a read of a lane
    that does not take part) and ``poison_shared`` (module docstring) update the settings on
    every call when given.
    """
    global _installed
    if poison_shared is not None:
        _settings["poison_shared"] = bool(poison_shared)
    if timeout is not None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        _settings["timeout"] = float(timeout)
    if strict is not None:
        _settings["strict"] = bool(strict)
    if not simulator_enabled():
        return False
    with _install_lock:
        if _installed:
            return True
        from numba import cuda
        from numba.cuda.simulator import kernel, kernelapi

        for name, fn in {**_INTRINSICS, **_BIT_INTRINSICS}.items():
            setattr(kernelapi.FakeCUDAModule, name, staticmethod(fn))
        for name, fn in _INTRINSICS.items():
            if not hasattr(cuda, name):
                setattr(cuda, name, fn)  # so that `from numba.cuda import shfl_sync` works too
        if not getattr(kernel.BlockThread.run, "_msa_simwarp", False):
            kernel.BlockThread.run = _wrap_thread_run(kernel.BlockThread.run)
        if (not getattr(kernel.BlockManager.run, "_msa_simwarp", False)
                and _manager_run_fits(kernel)):
            kernel.BlockManager.run = _block_manager_run
        if not getattr(kernel.swapped_cuda_module, "_msa_simwarp", False):
            kernel.swapped_cuda_module = _swapping_math(kernel.swapped_cuda_module)
        if not getattr(kernelapi.FakeCUDAShared.array, "_msa_simwarp", False):
            kernelapi.FakeCUDAShared.array = _locked_shared_array(kernelapi.FakeCUDAShared.array)
        _installed = True
    return True


def _locked_shared_array(original):
    """``FakeCUDAShared.array`` with its look-up-or-allocate under a lock.

    The simulator keys a block's static shared arrays by the calling line and allocates one on
    first use with ``get``, ``np.empty``, store: no lock. A thread switch inside that window
    (likely on an overloaded machine) gives the threads that run meanwhile private copies of a
    "shared" array, whose writes the rest of the block never sees: a correct kernel then fails
    now and then (seen in CI as whole rows of wrong KL gradients). Dynamic (size 0) arrays and
    the ``alignment`` error keep the original path.
    """
    import sys

    from numba.core import types
    from numba.np import numpy_support

    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)  # the simulator's own key
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = np.empty(shape, dtype)
                if _settings["poison_shared"]:
                    res.view(np.uint8)[...] = _POISON_BYTE
                self._allocations[caller] = res
        return res

    array._msa_simwarp = True
    return array


def settings() -> dict:
    """A copy of the current settings: ``timeout`` (s), ``strict``, ``poison_shared``."""
    return dict(_settings)
