"""The GPU's current SM clock, as `nvidia-smi` reports it: what a measurement records beside its
figures, because a Spark that has idled (a drained canary, a fresh restart) runs its GB10 at
about 600 MHz of 3,003 until work has kept it busy, and benchmarks at about a quarter speed.

Standard library only: the speed gate and the benchmark runner read it with the host's Python.
A machine without `nvidia-smi` (the lab) reports no clock: None, never a guess.
"""

from __future__ import annotations

import shutil
import subprocess

QUERY = ["--query-gpu=clocks.sm,clocks.max.sm", "--format=csv,noheader,nounits"]


def parse(output: str) -> tuple[int, int] | None:
    """(current, max) SM MHz of the first GPU in nvidia-smi's CSV answer; None where it says
    nothing usable (`[N/A]`, empty)."""
    for line in output.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and all(f.isdigit() for f in fields):
            return int(fields[0]), int(fields[1])
    return None


def sm_clock(nvidia_smi: str = "nvidia-smi", timeout_s: float = 10) -> tuple[int, int] | None:
    """(current, max) SM clock in MHz of the first GPU, or None where there is no nvidia-smi or
    it answers nothing usable."""
    path = shutil.which(nvidia_smi)
    if path is None:
        return None
    try:
        done = subprocess.run(
            [path, *QUERY], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse(done.stdout) if done.returncode == 0 else None


def differ(a_mhz: int | None, b_mhz: int | None, share: float) -> bool:
    """Whether two clocks differ by more than `share` of the higher one; unknown clocks (None)
    never count as differing: there is nothing to compare."""
    if a_mhz is None or b_mhz is None:
        return False
    return abs(a_mhz - b_mhz) > share * max(a_mhz, b_mhz)
