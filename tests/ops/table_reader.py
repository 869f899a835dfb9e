"""A real process that reads a packed table the way the serving backend does, for the metrics
tests: read-only mmap with MADV_RANDOM, rows copied out on request, counters kept in
sparkple.runtime.stats and written to a stats dir.

Protocol on stdin, one command a line, answered with one line on stdout:
  gather FIRST COUNT ROW_WIDTH   copy rows FIRST..FIRST+COUNT-1; answers "ok <checksum>"
  quit
"""

from __future__ import annotations

import mmap
import os
import sys
import time

from sparkple.runtime.stats import PLEStats, StatsFile


def main() -> int:
    data_path, stats_dir = sys.argv[1], sys.argv[2]
    fd = os.open(data_path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    table = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    table.madvise(mmap.MADV_RANDOM)
    stats = PLEStats()
    out = StatsFile(stats_dir, stats)
    out.write()
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["quit"]:
            break
        first, count, width = map(int, words[1:4])
        started = time.perf_counter()
        checksum = 0
        for row in range(first, first + count):
            checksum ^= int.from_bytes(table[row * width : row * width + 8], "little")
        stats.add("rows_gathered", count)
        stats.add("gather_calls")
        stats.observe_wait(time.perf_counter() - started)
        out.write()
        print(f"ok {checksum}", flush=True)
    table.close()
    os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
