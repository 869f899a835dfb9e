"""Memory watchdog: stop the serving container before unified memory runs out.

On a DGX Spark, running out of unified memory hangs the host without an OOM kill, so this
stops the serving container while there is still room to do it gracefully. Every interval it
reads /proc/meminfo; a sample is bad when
  - MemAvailable is below the floor, or
  - MemFree is below its floor while MemAvailable is below the gate (MemFree alone is low on a
    healthy host whose page cache is full; it only matters once MemAvailable is short too).
After `debounce` consecutive bad samples taken while the service runs it trips: it records an
emergency marker, archives the container's log, stops the container with a grace period (a
SIGKILL leaks POSIX shared memory under --ipc host), and sends an alert.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..meminfo import MEMINFO, read_meminfo
from .alert import Alerter
from .commands import run_command, service_options
from .state import iso, update_json, utc_stamp, write_json, write_marker

MIB = 1024 * 1024
MCL_CURRENT, MCL_FUTURE = 1, 2


def log(message: str) -> None:
    print(f"ple-watchdog: {message}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[service_options()])
    p.add_argument("--state-dir", type=Path, required=True, help="markers and state (shared)")
    p.add_argument("--log-dir", type=Path, required=True, help="where container logs are archived")
    p.add_argument("--interval-s", type=float, default=1.0, help="seconds between samples")
    p.add_argument("--debounce", type=int, default=5, help="consecutive bad samples to trip")
    p.add_argument("--avail-floor-mib", type=int, default=6144, help="MemAvailable floor")
    p.add_argument("--free-floor-mib", type=int, default=2048, help="MemFree floor")
    p.add_argument("--free-gate-mib", type=int, default=10240, help="MemFree counts below this")
    p.add_argument(
        "--running-cmd",
        default="systemctl is-active --quiet {unit}",
        help="exits 0 while the service runs",
    )
    p.add_argument(
        "--logs-cmd",
        default="docker logs --timestamps {container}",
        help="prints the container's log; its output is archived",
    )
    p.add_argument(
        "--stop-cmd",
        default="docker stop --time 30 {container}",
        help="stops the service gracefully",
    )
    p.add_argument("--stop-timeout-s", type=float, default=120.0, help="limit for --stop-cmd")
    p.add_argument("--mlock", action="store_true", help="lock the watchdog in RAM (needs root)")
    p.add_argument(
        "--meminfo",
        type=Path,
        default=MEMINFO,
        help="the file each sample reads (/proc/meminfo; a file in its format for a test)",
    )
    args = p.parse_args(argv)
    if args.interval_s <= 0 or args.debounce < 1:
        p.error("--interval-s must be > 0 and --debounce >= 1")
    return args


def lock_in_memory() -> None:
    """Keep the watchdog's own pages resident, so it still samples on time under pressure."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mlockall(MCL_CURRENT | MCL_FUTURE) != 0:
        log(f"mlockall failed (errno {ctypes.get_errno()}); running without it")


class Watchdog:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.avail_floor = args.avail_floor_mib * MIB
        self.free_floor = args.free_floor_mib * MIB
        self.free_gate = args.free_gate_mib * MIB
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=args.debounce)
        self.values = {"container": args.container, "unit": args.unit}
        self.alerter = Alerter(args.state_dir, min_interval_s=args.alert_min_interval_s)
        self.stop_event = threading.Event()
        self.trips = 0
        self.samples = 0
        self.last_state_write = 0.0
        self.started = time.time()
        self.idle_noted = False

    def reasons(self, avail: int, free: int) -> list[str]:
        found = []
        if avail < self.avail_floor:
            found.append(f"MemAvailable {avail // MIB} MiB < floor {self.avail_floor // MIB} MiB")
        if free < self.free_floor and avail < self.free_gate:
            found.append(
                f"MemFree {free // MIB} MiB < floor {self.free_floor // MIB} MiB "
                f"while MemAvailable {avail // MIB} MiB < gate {self.free_gate // MIB} MiB"
            )
        return found

    def sample(self) -> None:
        now = time.time()
        mem = read_meminfo(self.args.meminfo)
        avail, free = mem["MemAvailable"], mem["MemFree"]
        reasons = self.reasons(avail, free)
        self.samples += 1
        # Only samples taken while the service runs count: a stop is what a trip buys, and a
        # service relaunched into low memory gets the full debounce before it is stopped again.
        # The check costs a process start, so it runs only while memory is short.
        if reasons and self.service_running():
            reading = {"time": now, "mem_available_bytes": avail, "mem_free_bytes": free}
            self.recent.append({**reading, "reasons": reasons})
            self.idle_noted = False
        else:
            self.recent.clear()
            if reasons and not self.idle_noted:
                log(f"below the floor ({'; '.join(reasons)}) but the service is not running")
                self.idle_noted = True
        if len(self.recent) >= self.args.debounce:
            self.trip(now)
            self.recent.clear()
        if reasons or now - self.last_state_write >= 10 * self.args.interval_s:
            self.write_state(now, avail, free)

    def service_running(self) -> bool:
        return run_command(self.args.running_cmd, self.values, timeout_s=30).ok

    def write_state(self, now: float, avail: int, free: int) -> None:
        self.last_state_write = now
        # Rewritten every sample while memory is short: no fsync then, when it stalls most.
        write_json(
            self.args.state_dir / "watchdog.json",
            {
                "started": self.started,
                "updated": now,
                "updated_iso": iso(now),
                "mem_available_bytes": avail,
                "mem_free_bytes": free,
                "consecutive_bad": len(self.recent),
                "samples": self.samples,
                "trips": self.trips,
                "floors": {
                    "avail_floor_bytes": self.avail_floor,
                    "free_floor_bytes": self.free_floor,
                    "free_gate_bytes": self.free_gate,
                    "debounce": self.args.debounce,
                    "interval_s": self.args.interval_s,
                },
            },
            durable=False,
        )

    def trip(self, now: float) -> None:
        args = self.args
        readings = list(self.recent)
        reason = "; ".join(readings[-1]["reasons"])
        self.trips += 1
        log(f"EMERGENCY after {len(readings)} samples: {reason}; stopping {args.container}")
        payload: dict[str, Any] = {
            "reason": reason,
            "readings": readings,
            "floors_bytes": {
                "mem_available": self.avail_floor,
                "mem_free": self.free_floor,
                "free_gate": self.free_gate,
            },
            "container": args.container,
            "unit": args.unit,
        }
        # The marker is written first, so the incident is on disk even if what follows hangs.
        marker = write_marker(args.state_dir, "emergency", now, {**payload, "stopped": None})
        args.log_dir.mkdir(parents=True, exist_ok=True)
        archive = args.log_dir / f"{args.container}-{utc_stamp(now)}.log"
        logs = run_command(args.logs_cmd, self.values, timeout_s=60, stdout_path=archive)
        stop = run_command(args.stop_cmd, self.values, timeout_s=args.stop_timeout_s)
        stopped_at = time.time()
        result = {
            **payload,
            "log_archive": str(archive) if logs.ok else None,
            "log_archive_error": None if logs.ok else f"exit {logs.returncode}",
            "stopped": stop.ok,
            "stop_exit": stop.returncode,
            "stop_stderr": stop.stderr[-2000:],
            "stop_seconds": round(stopped_at - now, 3),
        }
        update_json(marker, result)
        outcome = "done" if stop.ok else f"FAILED (exit {stop.returncode})"
        log(f"stop {outcome} in {stopped_at - now:.1f} s; marker {marker}")
        self.alerter.send(
            "memory-emergency",
            f"memory watchdog stopped {args.container}: {reason}",
            {"marker": str(marker), "stopped": stop.ok},
        )

    def run(self) -> int:
        log(
            f"watching: MemAvailable floor {self.avail_floor // MIB} MiB, MemFree floor "
            f"{self.free_floor // MIB} MiB below {self.free_gate // MIB} MiB available, "
            f"{self.args.debounce} x {self.args.interval_s:g} s"
        )
        next_t = time.monotonic()
        while not self.stop_event.is_set():
            self.sample()
            next_t += self.args.interval_s
            delay = next_t - time.monotonic()
            if delay < 0:  # a trip took long: restart the cadence rather than burst
                next_t, delay = time.monotonic(), 0.0
            self.stop_event.wait(delay)
        self.alerter.drain()
        log("stopped")
        return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mlock:
        lock_in_memory()
    watchdog = Watchdog(args)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: watchdog.stop_event.set())
    return watchdog.run()


if __name__ == "__main__":
    sys.exit(main())
