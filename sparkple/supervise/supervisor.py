"""The supervisor of one Spark's serving unit, the loop of `supervisor run` (its policy:
sparkple.supervise.supervisor_cli): the service's state, relaunches with backoff, the readiness
deadline, hold and circuit breaker, the heartbeat and the table's I/O errors. A pair's
supervisors extend it (sparkple.pair.member)."""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

from .alert import Alerter
from .commands import run_command
from .devices import kernel_error_counts, table_device
from .probe import http_status
from .shm import clean_unheld
from .state import (
    INCIDENT_KINDS,
    iso,
    locked,
    manual_stop_path,
    read_json_object,
    read_markers,
    write_json,
)
from .status import one_line, report

HISTORY = 50


def log(message: str) -> None:
    print(f"ple-supervisor: {message}", flush=True)


def fresh_state() -> dict[str, Any]:
    return {
        "state": "starting",
        "restarts": 0,
        "launch_failures": 0,
        "launch_at": None,
        "ready_at": None,
        "healthy_since": None,
        "down_since": None,
        "next_attempt_at": None,
        "hold_reason": None,
        "breaker_open_since": None,
        "breaker_reset_at": 0.0,
        "last_heartbeat": None,
        "table_device": None,
        "table_io_errors_seen": 0,
        "history": [],
    }


class Supervisor:
    # "head" or "worker" for a node of a pair (sparkple.pair.member); None for a single Spark
    pair_role: str | None = None

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.state_dir: Path = args.state_dir
        self.path = self.state_dir / "supervisor.json"
        self.lock = self.state_dir / "supervisor.lock"
        self.values = {"unit": args.unit, "container": args.container}
        self.kinds = set(args.breaker_kinds.split(","))
        self.alerter = Alerter(self.state_dir, min_interval_s=args.alert_min_interval_s)
        self.table_device = table_device(args)
        # set by SIGTERM: its unit is being stopped, maybe as its node shuts down
        self.stopping = threading.Event()

    # -- state -------------------------------------------------------------------------------
    def fresh(self) -> dict[str, Any]:
        return fresh_state()

    def load(self) -> dict[str, Any]:
        # the saved state over a fresh one; what this program does not know is kept too:
        # `sparkple-ops reset` on a pair's node runs without the pair's flags and must not
        # drop the pair's state
        return {**self.fresh(), **read_json_object(self.path)}

    def save(self, st: dict[str, Any], now: float) -> None:
        st["updated"] = now
        st["updated_iso"] = iso(now)
        st["settings"] = {
            "backoff_base_s": self.args.backoff_base_s,
            "backoff_cap_s": self.args.backoff_cap_s,
            "stable_s": self.args.stable_s,
            "ready_timeout_s": self.args.ready_timeout_s,
            "hold_after": self.args.hold_after,
            "breaker_count": self.args.breaker_count,
            "breaker_window_s": self.args.breaker_window_s,
        }
        write_json(self.path, st)

    @staticmethod
    def record(st: dict[str, Any], now: float, event: str, **details: Any) -> None:
        st["history"] = [*st["history"], {"time": now, "event": event, **details}][-HISTORY:]
        log(f"{event} {json.dumps(details, sort_keys=True) if details else ''}".rstrip())

    def delay(self, restarts: int) -> float:
        base: float = self.args.backoff_base_s  # argparse type=float
        cap: float = self.args.backoff_cap_s
        return min(base * 2.0**restarts, cap)  # 2**int is typed Any (a negative power is float)

    def running(self) -> bool:
        return run_command(self.args.check_cmd, self.values, timeout_s=60).ok

    def healthy(self) -> bool:
        """/health answers 200 (always true without a health URL: then "up" is all we know)."""
        if not self.args.url:
            return True
        return http_status(self.args.url.rstrip("/") + "/health", self.args.health_timeout_s) == 200

    def clean_shm(self, st: dict[str, Any], now: float) -> None:
        """Remove the shared memory a stopped engine left, unless a live process holds any."""
        if not self.args.shm_patterns:
            return
        try:
            report = clean_unheld(self.args.shm_dir, self.args.shm_patterns.split(","))
        except OSError as exc:
            self.record(st, now, "shm-unreadable", error=str(exc))
            return
        if report["held"]:
            self.record(st, now, "shm-held", held=report["held"])
        elif report["removed"]:
            self.record(
                st, now, "shm-cleaned", removed=report["removed"], bytes=report["bytes_freed"]
            )

    def incidents(self, st: dict[str, Any], now: float) -> list[dict[str, Any]]:
        since = max(now - self.args.breaker_window_s, float(st["breaker_reset_at"] or 0.0))
        return read_markers(self.state_dir, self.kinds, since)

    # -- the loop ----------------------------------------------------------------------------
    def tick(self) -> dict[str, Any]:
        with locked(self.lock):
            now = time.time()
            st = self.load()
            if self.going_down():
                return st
            st["table_device"] = self.table_device  # for `status` run without --table-dir
            self.step(st, now)
            self.heartbeat(st, now)
            self.save(st, now)
            return st

    def going_down(self) -> bool:
        """Told to stop: decide and start nothing more. On a node that shuts down, a start
        fails (its systemd is going away), and that failure, saved, would be read after the
        boot as the next launch's."""
        return self.stopping.is_set()

    def heartbeat(self, st: dict[str, Any], now: float) -> None:
        """The opt-in daily "still alive" alert: silence from a host then means trouble."""
        if not self.args.heartbeat_s or not self.alerter.url:
            return
        last = st.get("last_heartbeat")
        if isinstance(last, int | float) and now - last < self.args.heartbeat_s:
            return
        rep = report(self.state_dir, self.args.kmsg, self.table_device)
        rep["supervisor"] = {k: v for k, v in st.items() if k != "history"}
        if self.alerter.send("heartbeat", f"heartbeat: {one_line(rep)}", {"report": rep}):
            st["last_heartbeat"] = now

    def hands_off(self, st: dict[str, Any], now: float, note: str) -> None:
        """The manual-stop flag: nothing is relaunched, and the streak starts over after it."""
        if st["state"] != "manual-stop":
            self.record(st, now, "manual-stop", note=note)
        st.update(state="manual-stop", restarts=0, launch_at=None, down_since=None)
        st.update(next_attempt_at=None, ready_at=None, healthy_since=None)

    def latched(self, st: dict[str, Any], now: float) -> bool:
        """Open the breaker when the incidents reached its count; True while it is open or the
        supervisor holds (nothing is relaunched then)."""
        args = self.args
        if st["breaker_open_since"] is None:
            incidents = self.incidents(st, now)
            if len(incidents) >= args.breaker_count:
                st["breaker_open_since"] = now
                self.record(st, now, "breaker-open", incidents=[m["path"] for m in incidents])
                self.alerter.send(
                    "breaker-open",
                    f"circuit breaker open after {len(incidents)} incidents in "
                    f"{args.breaker_window_s / 3600:g} h; not relaunching until reset",
                    {"incidents": [m.get("reason") for m in incidents]},
                )
        if st["breaker_open_since"] is not None:
            st.update(state="breaker-open", next_attempt_at=None)
            return True
        if st["hold_reason"] is not None:
            st.update(state="hold", next_attempt_at=None)
            return True
        return False

    def step(self, st: dict[str, Any], now: float) -> None:
        if manual_stop_path(self.state_dir).exists():
            self.hands_off(st, now, "flag present; not relaunching")
            return
        if self.latched(st, now):
            return

        if self.running():
            st.update(down_since=None, next_attempt_at=None)
            if st["launch_at"] is None:
                st["state"] = "running"
                return
            if self.watch_launch(st, now):
                return
            # never got ready: watch_launch stopped and counted it; relaunch after the backoff
            st.update(down_since=now, next_attempt_at=now + self.delay(st["restarts"]))
            if not self.hold_if_exhausted(st, now):
                st["state"] = "backoff"
            return

        # The service is down.
        self.check_table_io(st, now)
        if st["launch_at"] is not None:
            # A launch that did not reach `stable_s`: failed, unless an incident explains it.
            launched = st["launch_at"]
            explained = read_markers(self.state_dir, self.kinds | INCIDENT_KINDS, launched)
            lived = round(now - launched, 1)
            if explained:
                self.record(st, now, "down", cause=explained[-1].get("kind"), after_s=lived)
            else:
                st["launch_failures"] += 1
                self.record(st, now, "launch-failed", exited_after_s=lived)
            st.update(launch_at=None, ready_at=None, healthy_since=None)
        elif st["down_since"] is None:
            self.record(st, now, "down")
        if st["down_since"] is None:
            st["down_since"] = now
            st["next_attempt_at"] = now + self.delay(st["restarts"])
        if self.hold_if_exhausted(st, now):
            return
        if now < st["next_attempt_at"]:
            st["state"] = "backoff"
            return
        self.launch(st, now)

    def check_table_io(self, st: dict[str, Any], now: float) -> None:
        """A server that went down after new kernel I/O errors on the table's device most likely
        died of SIGBUS in its gather (a row's page-in failed): relaunching reads the same bad
        sectors, so say what a person must do."""
        if not self.table_device:
            return
        counts = kernel_error_counts(self.args.kmsg, self.table_device)
        seen = int(st.get("table_io_errors_seen") or 0)
        if counts is None or counts["table_io"] <= seen:
            return
        st["table_io_errors_seen"] = counts["table_io"]
        table = self.args.table_dir or "the PLE table"
        self.record(st, now, "table-io-errors", device=self.table_device, count=counts["table_io"])
        self.alerter.send(
            "table-io-errors",
            f"{self.args.unit} is down and the kernel logged {counts['table_io'] - seen} new I/O "
            f"errors on {self.table_device}, the device of {table}: reads of the table fail "
            f"(SIGBUS in the gather). Run `sparkple verify-table --full {table}` and rebuild "
            "the table (`sparkple build-table`, on a healthy disk) before relaunching.",
            {"device": self.table_device, "count": counts["table_io"]},
        )

    def watch_launch(self, st: dict[str, Any], now: float) -> bool:
        """Follow a launch until it is stable; False when it missed its readiness deadline
        (then it has been stopped and counted)."""
        args = self.args
        healthy = self.healthy()
        if healthy and st["ready_at"] is None:
            st["ready_at"] = now
            self.record(st, now, "ready", after_s=round(now - st["launch_at"], 1))
        if st["ready_at"] is None:
            if now - st["launch_at"] < args.ready_timeout_s:
                st["state"] = "launched"
                return True
            lived = round(now - st["launch_at"], 1)
            stop = run_command(args.stop_cmd, self.values, timeout_s=args.stop_timeout_s)
            st["launch_failures"] += 1
            self.record(st, now, "ready-timeout", after_s=lived, stop_exit=stop.returncode)
            self.alerter.send(
                "not-ready",
                f"{args.unit} did not pass /health within {args.ready_timeout_s:g} s of its "
                "launch; stopped it, will relaunch after the backoff",
                {"after_s": lived, "launch_failures": st["launch_failures"]},
            )
            st.update(launch_at=None, ready_at=None, healthy_since=None)
            return False
        if not healthy:
            st["healthy_since"] = None
        elif st["healthy_since"] is None:
            st["healthy_since"] = now
        if st["healthy_since"] is not None and now - st["healthy_since"] >= args.stable_s:
            self.record(st, now, "stable", after_s=round(now - st["launch_at"], 1))
            st.update(launch_at=None, ready_at=None, healthy_since=None)
            st.update(restarts=0, launch_failures=0)
            st["state"] = "running"
            return True
        st["state"] = "running"  # ready and serving; the backoff resets once it is stable
        return True

    def launch(self, st: dict[str, Any], now: float) -> None:
        if self.going_down():
            return
        waited = round(now - st["down_since"], 2)
        # the backoff this launch waited for (the history shows it doubling, whatever the load)
        backoff = round(st["next_attempt_at"] - st["down_since"], 3)
        self.clean_shm(st, now)
        result = run_command(self.args.start_cmd, self.values, timeout_s=self.args.start_timeout_s)
        st["restarts"] += 1
        if result.ok:
            self.record(
                st, now, "relaunch", attempt=st["restarts"], waited_s=waited, backoff_s=backoff
            )
            st.update(state="launched", launch_at=now, down_since=None, next_attempt_at=None)
            st.update(ready_at=None, healthy_since=None)
            return
        failed = {
            "attempt": st["restarts"],
            "waited_s": waited,
            "backoff_s": backoff,
            "exit": result.returncode,
        }
        # A watchdog that stopped the service while it was starting explains the failure.
        explained = read_markers(self.state_dir, self.kinds | INCIDENT_KINDS, now)
        if explained:
            self.record(st, now, "down", cause=explained[-1].get("kind"), **failed)
        else:
            st["launch_failures"] += 1
            self.record(st, now, "launch-failed", **failed, stderr=result.stderr[-500:])
        st.update(down_since=now, next_attempt_at=now + self.delay(st["restarts"]))
        if not self.hold_if_exhausted(st, now):
            st["state"] = "backoff"

    def restart_unit(self, st: dict[str, Any], now: float) -> tuple[bool, dict[str, Any]]:
        """The maintenance relaunch's stop and start (under the lock): whether both worked, and
        their exits for the record."""
        stop = run_command(self.args.stop_cmd, self.values, timeout_s=self.args.stop_timeout_s)
        start = run_command(self.args.start_cmd, self.values, timeout_s=self.args.start_timeout_s)
        if start.ok:
            st.update(state="launched", launch_at=now, ready_at=None, healthy_since=None)
        return stop.ok and start.ok, {"stop_exit": stop.returncode, "start_exit": start.returncode}

    def hold_if_exhausted(self, st: dict[str, Any], now: float) -> bool:
        """Hold when `hold_after` launches in a row failed; True when it holds."""
        if st["launch_failures"] < self.args.hold_after:
            return False
        self.hold(st, now, f"{st['launch_failures']} launches in a row failed")
        return True

    def hold(self, st: dict[str, Any], now: float, reason: str) -> None:
        st.update(state="hold", hold_reason=reason, next_attempt_at=None)
        self.record(st, now, "hold", reason=reason)
        self.alerter.send("supervisor-hold", f"supervisor holds: {reason}; reset to retry")

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())
        log(
            f"supervising {self.args.unit}: backoff {self.args.backoff_base_s:g} s x 2^n "
            f"(cap {self.args.backoff_cap_s:g} s), hold after {self.args.hold_after}, breaker "
            f"at {self.args.breaker_count} in {self.args.breaker_window_s:g} s"
        )
        while not self.stopping.is_set():
            self.tick()
            self.stopping.wait(self.args.poll_s)
        self.alerter.drain()
        return 0

    # -- operator commands -------------------------------------------------------------------
    def reset(self) -> int:
        with locked(self.lock):
            now = time.time()
            st = self.load()
            st.update(
                breaker_open_since=None,
                breaker_reset_at=now,
                hold_reason=None,
                launch_failures=0,
                restarts=0,
                launch_at=None,
                ready_at=None,
                healthy_since=None,
                down_since=None,
                next_attempt_at=None,
                state="reset",
            )
            self.record(st, now, "reset", note="breaker closed, hold cleared")
            self.save(st, now)
        return 0
