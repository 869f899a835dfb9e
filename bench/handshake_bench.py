"""The handshake benchmark of bench/ple_io.py: publish-to-observe latency across processes,
sparkple's shared-memory sequence flag against a pipe, and the CPU a waiter burns."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from measure import pct

from sparkple.runtime.handshake import Publisher, SeqFlag, Waiter

ROOT = Path(__file__).resolve().parents[1]


_PRODUCER = r"""
import os, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from sparkple.runtime.handshake import Publisher, SeqFlag
mode, delays = sys.argv[2], np.load(sys.argv[3])
if sys.argv[6] == "rt":
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
stamps = np.zeros(len(delays) + 1, dtype=np.int64)
if mode == "shm":
    flag = SeqFlag.attach(sys.argv[5])
    pub = Publisher(flag)
else:
    wfd = int(sys.argv[5])
sys.stdin.readline()  # start together
for i, delay in enumerate(delays.tolist(), start=1):
    time.sleep(delay)  # the stamp is taken after waking: only the publish-to-observe counts
    now = time.perf_counter_ns()
    if mode == "shm":
        pub.publish(i)
    else:
        os.write(wfd, b"!")
    stamps[i] = now  # kept here until the end, so no side channel sits in the timed path
stamps.tofile(sys.argv[4])
"""


def _handshake_run(mode: str, delays: np.ndarray, work: Path, rt: bool = False) -> np.ndarray:
    """Publish-to-observe latencies (s) for each delay; `mode` is shm (sparkple) or pipe.

    Both sides read the same clock (CLOCK_MONOTONIC): the producer stamps just before it
    publishes, the waiter just after it observes; the producer hands its stamps over at exit.
    rt: run both sides SCHED_FIFO, so CPU contention from other processes drops out and the
    figure is the mechanism's own.
    """
    np.save(work / "delays.npy", delays)
    stamps_path = work / "stamps.bin"
    stamps_path.unlink(missing_ok=True)
    flag = SeqFlag.create() if mode == "shm" else None
    rfd, wfd = os.pipe()
    target = str(flag.path) if flag is not None else str(wfd)
    proc = subprocess.Popen(
        [sys.executable, "-c", _PRODUCER, str(ROOT), mode, str(work / "delays.npy"),
         str(stamps_path), target, "rt" if rt else "-"],
        stdin=subprocess.PIPE,
        pass_fds=(wfd,),
        text=True,
    )  # fmt: skip
    os.close(wfd)
    seen = np.empty(len(delays) + 1, dtype=np.int64)
    policy = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        if rt:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        assert proc.stdin is not None
        waiter = Waiter(flag) if flag is not None else None
        time.sleep(0.3)  # the child has imported and attached
        proc.stdin.write("go\n")
        proc.stdin.flush()
        for i in range(1, len(delays) + 1):
            if waiter is not None:
                waiter.wait(i, timeout_s=10)
            else:
                os.read(rfd, 1)
            seen[i] = time.perf_counter_ns()
    finally:
        os.sched_setscheduler(0, *policy)
        proc.wait(timeout=30)
        os.close(rfd)
        if flag is not None:
            flag.close()
    if proc.returncode != 0:
        raise RuntimeError(f"the handshake producer ({mode}) exited {proc.returncode}")
    stamps = np.fromfile(stamps_path, dtype=np.int64)
    return (seen[1:] - stamps[1:]) / 1e9


def _idle_cpu(wait_s: float) -> float:
    """CPU fraction a waiter burns while the producer publishes only after wait_s."""
    with SeqFlag.create() as flag:
        pub = Publisher(flag)
        timer = threading.Timer(wait_s, pub.publish, args=(1,))
        timer.start()
        c0, t0 = time.thread_time(), time.perf_counter()
        Waiter(flag).wait(1, timeout_s=wait_s + 10)
        cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
        timer.join()
    return cpu / wall


def bench_handshake(n: int, rng) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sparkple-hs-") as tmp:
        work = Path(tmp)
        step = rng.uniform(0, 0.002, n)  # a decode step's gather finishing within 2 ms
        long = np.full(max(20, n // 20), 0.02)  # waits long enough to be sleeping
        shm = _handshake_run("shm", step, work)
        pipe = _handshake_run("pipe", step, work)
        shm_long = _handshake_run("shm", long, work)
        pipe_long = _handshake_run("pipe", long, work)
        shm_rt: np.ndarray | None
        pipe_rt: np.ndarray | None
        try:
            shm_rt = _handshake_run("shm", step, work, rt=True)
            pipe_rt = _handshake_run("pipe", step, work, rt=True)
        except PermissionError:  # no CAP_SYS_NICE / RLIMIT_RTPRIO here
            shm_rt = pipe_rt = None
    idle = _idle_cpu(1.0)
    us = 1e6
    return {
        "handshake_p50_us": pct(shm, 50) * us,
        "handshake_p99_us": pct(shm, 99) * us,
        "pipe_p50_us": pct(pipe, 50) * us,
        "pipe_p99_us": pct(pipe, 99) * us,
        "handshake_after_20ms_p50_us": pct(shm_long, 50) * us,
        "handshake_after_20ms_p99_us": pct(shm_long, 99) * us,
        "pipe_after_20ms_p50_us": pct(pipe_long, 50) * us,
        "pipe_after_20ms_p99_us": pct(pipe_long, 99) * us,
        "handshake_rt_p50_us": pct(shm_rt, 50) * us if shm_rt is not None else None,
        "handshake_rt_p99_us": pct(shm_rt, 99) * us if shm_rt is not None else None,
        "pipe_rt_p99_us": pct(pipe_rt, 99) * us if pipe_rt is not None else None,
        "handshake_idle_cpu_fraction": idle,
        "load_average": os.getloadavg(),
        "handshake_samples": n,
        "samples_us": {"shm": (shm * us).round(2).tolist(), "pipe": (pipe * us).round(2).tolist()},
    }
