"""The sequence handshake between real threads and real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from sparkple.errors import HandshakeError, HandshakeTimeout, ProducerDied
from sparkple.runtime.handshake import Publisher, SeqFlag, Waiter

# A producer process: attaches to the flag, fills a shared staging file with the step number
# before publishing each step, then blocks until killed.
PRODUCER = """
import sys, time
import numpy as np
from sparkple.runtime.handshake import Publisher, SeqFlag
flag = SeqFlag.attach(sys.argv[1])
staging = np.memmap(sys.argv[2], dtype=np.int64, mode="r+")
steps = int(sys.argv[3])
pub = Publisher(flag)
for seq in range(1, steps + 1):
    staging[:] = seq
    pub.publish(seq)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def flag():
    with SeqFlag.create() as f:
        yield f


def test_flag_file_lives_in_shared_memory_and_is_removed(flag):
    assert flag.path.exists()
    if os.path.isdir("/dev/shm"):
        assert flag.path.parent == Path("/dev/shm")
    assert flag.value == 0
    path = flag.path
    flag.close()
    assert not path.exists()


def test_threads_see_every_step_in_order(flag):
    staging = np.zeros(1024, dtype=np.int64)
    steps = 200

    def produce() -> None:
        pub = Publisher(flag)
        for seq in range(1, steps + 1):
            staging[:] = seq
            pub.publish(seq)
            time.sleep(0.0002 if seq % 2 else 0)

    waiter = Waiter(flag)
    t = threading.Thread(target=produce)
    t.start()
    for seq in range(1, steps + 1):
        seen = waiter.wait(seq, timeout_s=10)
        assert seen >= seq
        assert staging[0] >= seq and staging[-1] >= seq
    t.join()


def test_stale_and_repeated_seq_are_errors(flag):
    pub = Publisher(flag)
    pub.publish(3)
    with pytest.raises(HandshakeError, match="only move forward"):
        pub.publish(3)
    with pytest.raises(HandshakeError, match="only move forward"):
        pub.publish(2)
    assert flag.value == 3
    waiter = Waiter(flag)
    assert waiter.wait(2) == 3
    with pytest.raises(HandshakeError, match="once"):
        waiter.wait(2)
    with pytest.raises(HandshakeError, match="once"):
        waiter.wait(1)


def test_timeout_reports_seq_flag_and_elapsed(flag):
    pub = Publisher(flag)  # alive: this thread
    pub.publish(1)
    waiter = Waiter(flag)
    t0 = time.perf_counter()
    with pytest.raises(HandshakeTimeout) as info:
        waiter.wait(2, timeout_s=0.2)
    elapsed = time.perf_counter() - t0
    assert info.value.seq == 2 and info.value.flag == 1
    assert 0.2 <= info.value.elapsed_s <= elapsed < 2.0
    assert "seq 2" in str(info.value) and "flag still 1" in str(info.value)


def test_dead_producer_thread_is_detected(flag):
    ready = threading.Event()

    def produce_then_crash() -> None:
        Publisher(flag).publish(1)
        ready.set()
        # returns: the thread ends without publishing seq 2

    t = threading.Thread(target=produce_then_crash)
    t.start()
    ready.wait(5)
    t.join()
    waiter = Waiter(flag)
    assert waiter.wait(1) == 1
    t0 = time.perf_counter()
    with pytest.raises(ProducerDied, match="is gone"):
        waiter.wait(2, timeout_s=30)
    # found by a liveness check (every 50 ms), not at the timeout: far sooner than 30 s even
    # on a loaded machine, where a bound of 1 s was a flake
    assert time.perf_counter() - t0 < 0.1 * 30


def test_closed_producer_is_reported(flag):
    pub = Publisher(flag)
    pub.publish(1)
    pub.close()
    waiter = Waiter(flag)
    assert waiter.wait(1) == 1  # published before close: still delivered
    with pytest.raises(ProducerDied, match="closed"):
        waiter.wait(2, timeout_s=30)


def test_attach_refuses_other_files(tmp_path):
    other = tmp_path / "not-a-flag"
    other.write_bytes(b"\0" * 64)
    with pytest.raises(HandshakeError, match="bad magic"):
        SeqFlag.attach(other)
    with pytest.raises(HandshakeError, match="no sequence flag"):
        SeqFlag.attach(tmp_path / "missing")


def _start_producer(flag: SeqFlag, staging: Path, steps: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, str(flag.path), str(staging), str(steps)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_cross_process_steps_and_killed_producer(flag, tmp_path):
    staging_path = tmp_path / "staging.bin"
    np.zeros(4096, dtype=np.int64).tofile(staging_path)
    steps = 50
    proc = _start_producer(flag, staging_path, steps)
    try:
        staging = np.memmap(staging_path, dtype=np.int64, mode="r")
        waiter = Waiter(flag)
        assert waiter.wait(steps, timeout_s=10) == steps
        assert (staging == steps).all()  # the data published with the flag is complete

        # kill -9 the producer while we wait for a step it will never publish
        killed_at: list[float] = []

        def kill_soon() -> None:
            time.sleep(0.3)
            killed_at.append(time.perf_counter())
            os.kill(proc.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_soon)
        killer.start()
        with pytest.raises(ProducerDied, match=f"pid {proc.pid}"):
            waiter.wait(steps + 1, timeout_s=60)
        detected = time.perf_counter() - killed_at[0]
        killer.join()
        # a liveness check (every 50 ms) noticed, long before the 60 s timeout would have
        assert 0 <= detected < 0.05 * 60, f"took {detected:.3f} s to notice the dead producer"
    finally:
        proc.kill()
        proc.wait()


def test_a_waiting_consumer_sleeps_instead_of_burning_cpu(flag):
    pub = Publisher(flag)
    timer = threading.Timer(0.4, pub.publish, args=(1,))
    timer.start()
    cpu0, t0 = time.thread_time(), time.perf_counter()
    assert Waiter(flag).wait(1, timeout_s=10) == 1
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - t0
    timer.join()
    assert wall >= 0.35
    assert cpu < 0.1 * wall, f"the waiter used {cpu:.3f} s of CPU in {wall:.3f} s"
