"""The baselines the prefill gather is measured against (bench/ple_io.py): the device's own
4 KiB random-read rate, from threads at queue depth 1 or 32 and through Linux native AIO, and a
page cache filled by a pool of blocking preads instead of advice."""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from sparkple.runtime.prefetch import plan_page_numbers
from sparkple.runtime.table import PackedTable

PAGE = mmap.PAGESIZE


def device_random_reads(path: Path, size: int, reads: int, depth: int, rng) -> float:
    """4 KiB O_DIRECT random reads per second, `depth` threads each with one read in flight."""
    offsets = rng.integers(0, size // PAGE, reads) * PAGE
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        parts = np.array_split(offsets, depth)
        start = threading.Barrier(depth + 1)

        def work(part: np.ndarray) -> None:
            buf = mmap.mmap(-1, PAGE)  # page-aligned, as O_DIRECT needs
            start.wait()
            for off in part.tolist():
                os.preadv(fd, [buf], off)
            buf.close()

        with ThreadPoolExecutor(depth) as pool:
            futures = [pool.submit(work, p) for p in parts]
            start.wait()
            t0 = time.perf_counter()
            for f in futures:
                f.result()
            return reads / (time.perf_counter() - t0)
    finally:
        os.close(fd)


# Linux native AIO through raw syscalls: O_DIRECT reads kept `depth` deep by the kernel, with
# no per-read thread handoff, so the figure is the device's, not Python's.
# io_setup, io_submit, io_getevents, io_destroy
_AIO_NR = {"x86_64": (206, 209, 208, 207), "aarch64": (0, 2, 4, 1)}


def device_random_reads_aio(path: Path, size: int, reads: int, depth: int, rng) -> float | None:
    """4 KiB O_DIRECT random reads per second at queue depth `depth` via io_submit."""
    import ctypes

    class Iocb(ctypes.Structure):  # struct iocb, little-endian layout
        _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32),
                    ("rw_flags", ctypes.c_uint32), ("opcode", ctypes.c_uint16),
                    ("prio", ctypes.c_int16), ("fd", ctypes.c_uint32), ("buf", ctypes.c_uint64),
                    ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                    ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32),
                    ("resfd", ctypes.c_uint32)]  # fmt: skip

    class Event(ctypes.Structure):
        _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64),
                    ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]  # fmt: skip

    nrs = _AIO_NR.get(os.uname().machine)
    if nrs is None:
        return None
    setup, submit, getevents, destroy = nrs
    syscall = ctypes.CDLL(None, use_errno=True).syscall
    syscall.restype = ctypes.c_long
    ctx = ctypes.c_ulong(0)
    if syscall(setup, depth, ctypes.byref(ctx)) < 0:
        return None
    offsets = (rng.integers(0, size // PAGE, reads) * PAGE).tolist()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    bufs = mmap.mmap(-1, depth * PAGE)  # page-aligned, as O_DIRECT needs
    anchor = ctypes.c_char.from_buffer(bufs)
    base = ctypes.addressof(anchor)
    iocbs = (Iocb * depth)()
    for i in range(depth):
        iocbs[i].data, iocbs[i].fd, iocbs[i].nbytes = i, fd, PAGE
        iocbs[i].buf = base + i * PAGE
    batch = (ctypes.POINTER(Iocb) * depth)()
    pointers = [ctypes.pointer(iocbs[i]) for i in range(depth)]
    events = (Event * depth)()
    try:
        t0 = time.perf_counter()
        issued = done = 0
        free = list(range(depth))
        while done < reads:
            n = min(len(free), reads - issued)
            for k in range(n):  # refill every free slot, submit them in one call
                i = free.pop()
                iocbs[i].offset = offsets[issued + k]
                batch[k] = pointers[i]
            if n and syscall(submit, ctx, ctypes.c_long(n), batch) != n:
                return None
            issued += n
            got = syscall(getevents, ctx, ctypes.c_long(1), ctypes.c_long(depth), events, None)
            if got < 0:
                return None
            for e in events[:got]:
                if e.res != PAGE:
                    return None
                free.append(e.data)
            done += got
        return reads / (time.perf_counter() - t0)
    finally:
        syscall(destroy, ctx)
        os.close(fd)
        del anchor
        bufs.close()


class PreadPool:
    """A bench-only alternative to advice: 32 threads each pread one byte of every page the
    batch touches (the table's fd has POSIX_FADV_RANDOM: no readahead), i.e. the page cache
    filled by blocking reads at depth 32."""

    mechanism = "pread_pool"

    def __init__(self, table: PackedTable, threads: int = 32) -> None:
        self.fd, self.width, self.threads = table.fd, table.row_width, threads
        self.pool = ThreadPoolExecutor(threads)

    def _read(self, offsets: np.ndarray) -> None:
        for off in offsets.tolist():
            os.pread(self.fd, 1, off)

    def prefetch(self, ids: np.ndarray) -> None:
        offsets = plan_page_numbers(ids, self.width) * PAGE
        for f in [self.pool.submit(self._read, p) for p in np.array_split(offsets, self.threads)]:
            f.result()

    def forget(self) -> None:
        pass

    def close(self) -> None:
        self.pool.shutdown()
