"""Host-side completion handshake between the CPU gather worker and the GPU forward.

One int64 sequence flag lives in shared memory (a small file in /dev/shm, mapped by every
party, so it works between threads and between processes). The producer publishes `seq`
only after its rows are in the staging buffer; the consumer waits until the flag reaches
`seq`. GB10 has no CUDA stream-memory-op semaphores, so this replaces them on the host.

The waiter polls briefly, then sleeps in short futex waits on the flag's word, which the
publisher wakes right after each publish: a kernel wakeup does not lose whole scheduler slices
on a busy host as a polling or time-sleeping waiter does, costs no CPU while idle, needs no file
descriptor shared between the parties, and releases the GIL, so a producer thread in the same
process runs freely.

Sequence numbers start at 1 and only move forward: publishing a seq that is not above the
flag, or waiting twice for the same seq, is a protocol error (HandshakeError), never a hang.
Next to the flag the header records who the producer is (pid, thread id, start time), so a
waiter notices within about a second when that thread or process is gone (ProducerDied)
instead of waiting out its timeout.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import HandshakeError, HandshakeTimeout, ProducerDied

# Header layout: int64 slots in one 64-byte line.
_SEQ, _MAGIC, _PID, _TID, _START, _STATE = range(6)
_HEADER_BYTES = 64
_MAGIC_VALUE = 0x53504B4C53455131  # "SPKLSEQ1"
_STATE_NONE, _STATE_LIVE, _STATE_CLOSED = 0, 1, 2

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_SPIN_S = 0.00005  # poll this long first when the producer is another process
_SLEEP_STEP_S = 0.01  # futex wait per step; a publish ends it at once
_POLL_STEP_S = 0.0002  # sleep per step where futexes are unavailable
_LIVENESS_EVERY_S = 0.05

_SHM_DIR = "/dev/shm"


_FENCE = threading.Lock()


def _ordering_fence() -> None:
    """A full memory barrier from pure Python.

    A lock release followed by an acquire is a release-then-acquire pair, which orders every
    store before it ahead of every store after it, also on arm64 (GB10): the staging rows
    become visible no later than the flag that announces them.
    """
    _FENCE.acquire()
    _FENCE.release()
    _FENCE.acquire()
    _FENCE.release()


def _task_identity(pid: int, tid: int) -> int | None:
    """The start time (clock ticks since boot) of a live task, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Fields after the parenthesised command name: state is the first, starttime the 20th.
    rest = stat[stat.rindex(b")") + 2 :].split()
    if rest[0] in (b"Z", b"X"):
        return None
    return int(rest[19])


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Futex:
    """FUTEX_WAIT / FUTEX_WAKE on a 32-bit word of a shared mapping (not process-private).

    The calls are built once per word, not per call: a publish runs right after the producer's
    copy, often with cold caches, where rebuilding the ctypes arguments each time showed (a
    publish after a 20 ms sleep took 86 us median with them rebuilt, 65 us without).
    """

    _NR = {"x86_64": 202, "aarch64": 98}
    _WAIT, _WAKE = 0, 1

    def __init__(self) -> None:
        self.nr = self._NR.get(os.uname().machine, -1)
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        self._syscall.restype = ctypes.c_long

    @property
    def usable(self) -> bool:
        return self.nr >= 0

    def waker(self, address: int) -> Callable[[], object]:
        """A call that wakes every waiter sleeping on the word at `address`."""
        word, everyone = ctypes.c_void_p(address), 0x7FFFFFFF
        return functools.partial(self._syscall, self.nr, word, self._WAKE, everyone, None, None, 0)

    def sleeper(self, address: int) -> Callable[[int, float], object]:
        """`sleep(expected, timeout_s)`: sleep until woken or timeout_s passes, unless the
        word at `address` no longer holds `expected`. The GIL is released meanwhile."""
        word, timeout = ctypes.c_void_p(address), _Timespec()
        timeout_ref = ctypes.byref(timeout)

        def sleep(expected: int, timeout_s: float) -> None:
            timeout.tv_sec, timeout.tv_nsec = int(timeout_s), int((timeout_s % 1) * 1e9)
            value = ctypes.c_uint32(expected)
            self._syscall(self.nr, word, self._WAIT, value, timeout_ref, None, 0)

        return sleep


_FUTEX = _Futex()


def _no_wake() -> None:
    """Where futexes are unavailable waiters poll: there is nobody to wake."""


class SeqFlag:
    """One int64 sequence flag (plus a small producer header) in shared memory.

    `SeqFlag.create()` makes a new flag file in /dev/shm; other processes `SeqFlag.attach(path)`
    to the same file. The creator unlinks it on `close()` (or `unlink()` explicitly).
    """

    def __init__(self, path: Path, *, owner: bool) -> None:
        self.path = path
        self._owner = owner
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < _HEADER_BYTES:
                raise HandshakeError(
                    f"{path} is not a sparkple sequence flag (too small); "
                    "pass the path SeqFlag.create() returned"
                )
            self._mm = mmap.mmap(fd, _HEADER_BYTES, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._slots = memoryview(self._mm).cast("q")
        anchor = ctypes.c_char.from_buffer(self._mm)
        self._address = ctypes.addressof(anchor)  # the seq's low 32 bits: the futex word
        del anchor  # keep no export alive, or the mapping could not be closed
        if self._slots[_MAGIC] != _MAGIC_VALUE:
            self.close()
            raise HandshakeError(f"{path} is not a sparkple sequence flag (bad magic)")

    @classmethod
    def create(cls, directory: str | os.PathLike[str] | None = None) -> SeqFlag:
        """A new flag at seq 0 in `directory` (default /dev/shm, else the temp dir)."""
        if directory is None:
            directory = _SHM_DIR if os.path.isdir(_SHM_DIR) else tempfile.gettempdir()
        fd, name = tempfile.mkstemp(prefix="sparkple-seq-", dir=directory)
        try:
            os.ftruncate(fd, _HEADER_BYTES)
            with mmap.mmap(fd, _HEADER_BYTES) as mm:
                memoryview(mm).cast("q")[_MAGIC] = _MAGIC_VALUE
        finally:
            os.close(fd)
        return cls(Path(name), owner=True)

    @classmethod
    def attach(cls, path: str | os.PathLike[str]) -> SeqFlag:
        try:
            return cls(Path(path), owner=False)
        except FileNotFoundError:
            raise HandshakeError(
                f"no sequence flag at {path}: the producer has not created it or already closed it"
            ) from None

    @property
    def value(self) -> int:
        return self._slots[_SEQ]

    def _get(self, slot: int) -> int:
        return self._slots[slot]

    def _set(self, slot: int, value: int) -> None:
        self._slots[slot] = value

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._mm.closed:
            return
        self._slots.release()
        self._mm.close()
        if self._owner:
            self.unlink()

    def __enter__(self) -> SeqFlag:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Publisher:
    """The producer side: `publish(seq)` after the staging copy for `seq` is complete.

    The producer is the thread that calls `claim()` (done at construction); a waiter watches
    that thread and its process.
    """

    def __init__(self, flag: SeqFlag) -> None:
        self.flag = flag
        self._wake = _FUTEX.waker(flag._address) if _FUTEX.usable else _no_wake
        self.claim()

    def claim(self) -> None:
        """Make the calling thread the producer a waiter watches for liveness."""
        pid, tid = os.getpid(), threading.get_native_id()
        start = _task_identity(pid, tid)
        self.flag._set(_PID, pid)
        self.flag._set(_TID, tid)
        self.flag._set(_START, start if start is not None else 0)
        self.flag._set(_STATE, _STATE_LIVE)

    def publish(self, seq: int) -> None:
        slots = self.flag._slots
        if seq <= slots[_SEQ]:
            raise HandshakeError(
                f"publish({seq}) but the flag is already at {slots[_SEQ]}: sequence numbers "
                "only move forward; the caller reused or reordered a step number"
            )
        _ordering_fence()
        slots[_SEQ] = seq
        self._wake()

    def close(self) -> None:
        """Tell waiters that nothing more will be published (they get ProducerDied)."""
        self.flag._set(_STATE, _STATE_CLOSED)
        self._wake()


class Waiter:
    """The consumer side: `wait(seq)` returns once the flag has reached `seq`.

    It polls for `spin_s` (default: 50 us when the producer is another process, none when it
    is a thread of this one, which needs the CPU and the GIL), then sleeps in futex waits of
    at most 10 ms that the publisher cuts short, checking every `liveness_every_s` that the
    producer is still there.
    """

    def __init__(
        self,
        flag: SeqFlag,
        *,
        spin_s: float | None = None,
        liveness_every_s: float = _LIVENESS_EVERY_S,
    ) -> None:
        self.flag = flag
        self._sleep = _FUTEX.sleeper(flag._address) if _FUTEX.usable else None
        self.spin_s = spin_s
        self.liveness_every_s = liveness_every_s
        self.last_seq = 0

    def wait(self, seq: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
        """Block until the flag is >= seq; returns the flag value seen."""
        if seq <= self.last_seq:
            raise HandshakeError(
                f"wait({seq}) after wait({self.last_seq}): a consumer waits for each step once, "
                "in increasing order"
            )
        value = self._wait(seq, timeout_s)
        self.last_seq = seq
        _ordering_fence()  # the staging reads that follow must not see older bytes
        return value

    def _wait(self, seq: int, timeout_s: float) -> int:
        slots = self.flag._slots
        value = slots[_SEQ]
        if value >= seq:
            return value
        start = time.perf_counter()
        deadline = start + timeout_s
        spin_s = self.spin_s
        if spin_s is None:
            spin_s = 0.0 if self.flag._get(_PID) == os.getpid() else DEFAULT_SPIN_S
        while time.perf_counter() - start < spin_s:
            value = slots[_SEQ]
            if value >= seq:
                return value
        next_check = start + self.liveness_every_s
        while True:
            value = slots[_SEQ]
            if value >= seq:
                return value
            now = time.perf_counter()
            if now >= next_check:
                self._check_producer(seq)
                next_check = now + self.liveness_every_s
            if now >= deadline:
                raise HandshakeTimeout(seq, value, now - start)
            pause = min(next_check, deadline) - now
            if self._sleep is not None:
                self._sleep(value & 0xFFFFFFFF, min(pause, _SLEEP_STEP_S))
            else:
                time.sleep(min(pause, _POLL_STEP_S))

    def _check_producer(self, seq: int) -> None:
        flag = self.flag
        state = flag._get(_STATE)
        if state == _STATE_NONE:
            return  # no producer has claimed the flag yet: only the timeout applies
        pid, tid = flag._get(_PID), flag._get(_TID)
        if state == _STATE_CLOSED:
            # One last look: the final publish may have landed just before close().
            if flag.value >= seq:
                return
            raise ProducerDied(
                f"waiting for seq {seq} but the producer (pid {pid}, thread {tid}) closed at "
                f"seq {flag.value}: it will publish nothing more"
            )
        if _task_identity(pid, tid) != flag._get(_START) and flag.value < seq:
            raise ProducerDied(
                f"waiting for seq {seq} (flag at {flag.value}) but the producer (pid {pid}, "
                f"thread {tid}) is gone: it crashed or was killed; restart the gather worker"
            )
