"""The memory watchdog against the real /proc/meminfo: floors are set above (or below) what this
machine really has, and the thing it stops is a real process."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import struct
import subprocess
import termios
import time
from pathlib import Path

from ops_helpers import above_real_memory, markers, output, read_json, wait_for, watchdog_cmd

INTERVAL = 0.1


def watchdog(state: Path, *args: object) -> list[str]:
    return watchdog_cmd(
        state, "--container", "lab-vllm", "--debounce", 5, *args, interval_s=INTERVAL
    )


def finished_emergency(state: Path, timeout_s: float) -> dict:
    """The first emergency marker whose stop attempt has finished (stopped or not)."""
    return wait_for(
        lambda: [m for m in markers(state, "emergency") if m.get("stopped") is not None],
        timeout_s,
        "an emergency stop to finish",
    )[0]


def test_trips_after_debounce_archives_log_and_stops_the_service(tmp_path, lab, procs):
    lab.start()
    state = tmp_path / "state"
    started = time.monotonic()
    wd = procs(
        watchdog(
            state,
            "--avail-floor-mib",
            above_real_memory(),
            *lab.watchdog_args(),
        )  # fmt: skip
    )
    marker = finished_emergency(state, 15)
    elapsed = time.monotonic() - started

    readings = marker["readings"]
    assert len(readings) == 5, "trips on the fifth consecutive bad sample"
    floor = above_real_memory() * 1024 * 1024
    assert all(r["mem_available_bytes"] < floor for r in readings)
    span = readings[-1]["time"] - readings[0]["time"]
    assert span >= 4 * INTERVAL * 0.9, f"five samples must span four intervals, got {span:.3f} s"
    assert "MemAvailable" in marker["reason"]
    assert marker["stopped"] is True and marker["stop_exit"] == 0
    assert not lab.active(), "the service was stopped"
    archive = Path(marker["log_archive"])
    assert archive.parent == tmp_path / "logs" and archive.name.startswith("lab-vllm-")
    assert "lab_server: listening on" in archive.read_text(), "the service's log was archived"
    assert "SIGTERM" in (lab.dir / "server.log").read_text(), "stopped gracefully (SIGTERM)"
    assert elapsed < 10

    wd.send_signal(signal.SIGTERM)
    assert wd.wait(5) == 0
    assert "EMERGENCY after 5 samples" in output(wd)


def test_memfree_floor_counts_only_while_memavailable_is_below_the_gate(tmp_path, procs):
    target = subprocess.Popen(["sleep", "300"])
    try:
        gated_out = tmp_path / "gated"
        huge = above_real_memory()
        common = ("--running-cmd", f"kill -0 {target.pid}", "--stop-cmd", f"kill {target.pid}")
        # MemFree below its floor, but MemAvailable is above the gate: a full page cache, fine.
        wd = procs(
            watchdog(
                gated_out / "state",
                "--avail-floor-mib",
                0,
                "--free-floor-mib",
                huge,
                "--free-gate-mib",
                0,
                "--logs-cmd",
                "true",
                *common,
            )  # fmt: skip
        )
        wait_for(
            lambda: read_json(gated_out / "state" / "watchdog.json").get("samples", 0) >= 12,
            10,
            "twelve samples",
        )
        assert markers(gated_out / "state", "emergency") == []
        assert target.poll() is None, "nothing was stopped"
        wd.terminate()
        wd.wait(5)

        # The same MemFree reading with MemAvailable below the gate trips.
        state = tmp_path / "state"
        procs(
            watchdog(
                state,
                "--avail-floor-mib",
                0,
                "--free-floor-mib",
                huge,
                "--free-gate-mib",
                huge,
                "--logs-cmd",
                "true",
                *common,
            )  # fmt: skip
        )
        marker = wait_for(
            lambda: [m for m in markers(state, "emergency") if m.get("stopped")], 10, "a trip"
        )[0]
        assert "MemFree" in marker["reason"] and "gate" in marker["reason"]
        assert "MemAvailable" not in marker["reason"].split(" while ")[0]
        assert target.wait(5) == -signal.SIGTERM
    finally:
        target.kill()
        target.wait()


def test_no_marker_when_the_service_is_not_running(tmp_path, procs):
    state = tmp_path / "state"
    wd = procs(
        watchdog(
            state,
            "--avail-floor-mib",
            above_real_memory(),
            "--running-cmd",
            "false",
            "--stop-cmd",
            f"touch {tmp_path / 'stopped'}",
        )  # fmt: skip
    )
    wait_for(lambda: "service is not running" in output(wd), 10, "the watchdog to notice")
    assert markers(state, "emergency") == []
    assert not (tmp_path / "stopped").exists()
    # the state file is written just after that log line
    status = wait_for(lambda: read_json(state / "watchdog.json"), 10, "the watchdog's state file")
    assert status["trips"] == 0 and status["mem_available_bytes"] > 0


def test_a_failing_stop_is_recorded(tmp_path, procs):
    state = tmp_path / "state"
    procs(
        watchdog(
            state,
            "--avail-floor-mib",
            above_real_memory(),
            "--running-cmd",
            "true",
            "--logs-cmd",
            "no-such-program-here",
            "--stop-cmd",
            "false",
        )  # fmt: skip
    )
    marker = finished_emergency(state, 10)
    assert marker["stopped"] is False and marker["stop_exit"] == 1
    assert marker["log_archive"] is None and marker["log_archive_error"] == "exit 127"


def test_bad_settings_are_refused(tmp_path):
    done = subprocess.run(
        watchdog(tmp_path, "--debounce", 0), capture_output=True, text=True, timeout=20
    )
    assert done.returncode == 2 and "--debounce" in done.stderr


def meminfo_text(avail_mib: int, free_mib: int) -> str:
    return (
        f"MemTotal:       {128 * 1024 * 1024} kB\n"
        f"MemFree:        {free_mib * 1024} kB\n"
        f"MemAvailable:   {avail_mib * 1024} kB\n"
    )


def holds_open(pid: int, path: Path) -> bool:
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            if os.readlink(fd) == str(path):
                return True
        except OSError:
            continue
    return False


def unread(fd: int) -> int:
    """Bytes written to the FIFO that no reader has taken yet."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]


def feed(pid: int, fifo: Path, text: str, timeout_s: float = 20) -> None:
    """Hand the watchdog (pid) its next sample through the FIFO it reads once per sample.

    Waits until its previous read has closed the FIFO (a read that has seen EOF but not closed
    would swallow this sample), writes, and closes only once the reader has taken every byte
    (one sample per read, never two). When this returns, every earlier sample was handled."""
    wait_for(lambda: not holds_open(pid, fifo), timeout_s, "the previous read to close")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:  # ENXIO: no reader yet (the watchdog is between samples)
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                raise
            time.sleep(0.005)
    try:
        os.set_blocking(fd, True)
        os.write(fd, text.encode())
        wait_for(lambda: unread(fd) == 0, timeout_s, "the watchdog to read the sample")
    finally:
        os.close(fd)


def test_a_good_sample_between_bad_ones_resets_the_debounce(tmp_path, procs):
    """Samples fed one by one through --meminfo (a FIFO): bad, bad, good, bad, bad is never three
    bad in a row, so no trip with a debounce of 3; the next bad one trips, with the three."""
    state = tmp_path / "state"
    fifo = tmp_path / "meminfo"
    os.mkfifo(fifo)
    stopped = tmp_path / "stopped"
    wd = procs(
        watchdog_cmd(
            state,
            "--container",
            "lab-vllm",
            "--debounce",
            3,
            "--avail-floor-mib",
            6144,
            "--free-floor-mib",
            16,
            "--meminfo",
            fifo,
            "--running-cmd",
            "true",
            "--logs-cmd",
            "echo container log",
            "--stop-cmd",
            f"touch {stopped}",
            interval_s=0.05,
        )  # fmt: skip
    )
    bad, good = meminfo_text(1000, 500), meminfo_text(50_000, 40_000)
    for text in (bad, bad, good, bad, bad):
        feed(wd.pid, fifo, text)
    feed(wd.pid, fifo, bad)  # the third bad in a row; this returns once the fifth was handled
    assert markers(state, "emergency") == [], "tripped on bad samples that were not consecutive"
    assert not stopped.exists()
    feed(wd.pid, fifo, good)  # returns once the sixth (the third bad in a row) was handled
    [marker] = markers(state, "emergency")
    assert [r["mem_available_bytes"] for r in marker["readings"]] == [1000 * 1024 * 1024] * 3
    assert "MemAvailable 1000 MiB < floor 6144 MiB" in marker["reason"]
    wait_for(stopped.exists, 10, "the stop command")
    feed(wd.pid, fifo, good)
    assert len(markers(state, "emergency")) == 1, "the good sample after the trip trips nothing"
