"""The WILLNEED advice a Prefetcher gives, recorded at the call that reaches the kernel.

WILLNEED only starts reads, and the kernel may drop them (memory pressure, a busy disk): which
pages became resident by some deadline is the kernel's business. Which pages the prefetcher
advised is what it guarantees, and that is what the tests compare with the plan.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

P = mmap.PAGESIZE


class AdviceLog:
    """Records the WILLNEED advice a Prefetcher gives, at the call that reaches the kernel,
    as sorted page numbers of the table (a page advised twice appears twice)."""

    def __init__(self, pf, monkeypatch):
        self.pages: list[int] = []
        self.calls = 0
        self._lock = threading.Lock()  # the prefetcher's pool advises from two threads
        base = pf.rows.ctypes.data
        if pf.mechanism == "process_madvise":
            libc = pf._pm._libc

            class Libc:  # the syscall with the iovec array it was given, read back
                def syscall(this, nr, *args):
                    done = libc.syscall(nr, *args)
                    if nr != pf._pm._nr:  # pidfd_open
                        return done
                    _, iov, count, advice, _ = args
                    if count.value:
                        assert advice == mmap.MADV_WILLNEED
                        vec = (ctypes.c_uint64 * (2 * count.value)).from_address(iov.value)
                        pairs = [(vec[2 * i] - base, vec[2 * i + 1]) for i in range(count.value)]
                        # process_madvise returns the bytes it advised: all of them, or -1
                        assert done == sum(n for _, n in pairs), (done, pairs[:3])
                        self.add(pairs)
                    return done

            monkeypatch.setattr(pf._pm, "_libc", Libc())
        elif pf.mechanism == "madvise":
            mm = pf._mmap

            class Map:  # an mmap's methods cannot be patched: wrap the object the pool uses
                def madvise(this, advice, start, length):
                    assert advice == mmap.MADV_WILLNEED
                    self.add([(start, length)])
                    return mm.madvise(advice, start, length)

            monkeypatch.setattr(pf, "_mmap", Map())
        else:
            fadvise = os.posix_fadvise

            def recording(fd, offset, length, advice):
                if fd == pf.fd:
                    assert advice == os.POSIX_FADV_WILLNEED
                    self.add([(offset, length)])
                return fadvise(fd, offset, length, advice)

            monkeypatch.setattr(os, "posix_fadvise", recording)

    def add(self, ranges):
        for start, length in ranges:
            assert start % P == 0 and length % P == 0 and length > 0, (start, length)
        with self._lock:
            self.calls += 1
            for start, length in ranges:
                self.pages.extend(range(start // P, (start + length) // P))

    def advised(self) -> list[int]:
        with self._lock:
            return sorted(self.pages)
