"""A read-only FUSE file system over a directory whose reads of one file fail in a byte range.

Usage: faulty_fs.py SOURCE MOUNTPOINT FILE BAD_START BAD_END

Every file of SOURCE is served as it is, except that a read of FILE overlapping
[BAD_START, BAD_END) fails with EIO, as a disk's unreadable sector does. Through an mmap the
kernel turns that failed page-in into SIGBUS for the faulting thread. Runs in the foreground
until unmounted (fusermount -u, or umount as root). A stand-in for a device-mapper `error`
target, which needs a kernel with device-mapper (this one's has none).
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

from fuse import FUSE, FuseOSError, Operations


class FaultyFS(Operations):
    def __init__(self, source: str, faulty: str, bad_start: int, bad_end: int) -> None:
        self.source = source
        self.faulty = "/" + faulty.strip("/")
        self.bad = (bad_start, bad_end)
        self.failed_reads = 0

    def _real(self, path: str) -> str:
        return os.path.join(self.source, path.lstrip("/"))

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        st = os.lstat(self._real(path))
        keys = ("st_mode", "st_size", "st_nlink", "st_uid", "st_gid", "st_atime", "st_mtime")
        return {k: getattr(st, k) for k in (*keys, "st_ctime")}

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._real(path))]

    def open(self, path: str, flags: int) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise FuseOSError(errno.EROFS)
        return os.open(self._real(path), os.O_RDONLY)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        if path == self.faulty and offset < self.bad[1] and offset + size > self.bad[0]:
            self.failed_reads += 1
            raise FuseOSError(errno.EIO)
        return os.pread(fh, size, offset)

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    source, mountpoint, faulty, start, end = argv
    FUSE(FaultyFS(source, faulty, int(start), int(end)), mountpoint, foreground=True, ro=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
