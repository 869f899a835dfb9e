#!/usr/bin/env python3
"""Supervisor: relaunch the serving unit with backoff, and know when to stop trying.

The serving unit has no restart policy of its own; this loop owns relaunching it:
  - a down service is relaunched after base x 2^n seconds (n: launches since the service was
    last up for `stable_s`), capped;
  - after `hold_after` consecutive failed launches (the start command fails, or the service
    exits before `stable_s` without an incident marker explaining it) it holds;
  - after `breaker_count` incidents (watchdog emergency markers) within `breaker_window_s` the
    circuit breaker opens: a host that keeps running out of memory needs a person, not retries;
  - the manual-stop flag (written by the stop playbook or `manual-stop`) means hands off.
Hold and breaker latch until `reset`. State is in <state-dir>/supervisor.json; `status` prints
it together with the watchdog's and the probe's state.

Subcommands: run, status, reset, manual-stop, resume, relaunch (drain, then stop and start:
the weekly maintenance relaunch).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from ple_alert import Alerter
from ple_host import run_command
from ple_state import (
    INCIDENT_KINDS,
    iso,
    locked,
    manual_stop_path,
    read_json,
    read_json_object,
    read_markers,
    write_json,
)

HISTORY = 50


def log(message: str) -> None:
    print(f"ple-supervisor: {message}", flush=True)


def fresh_state() -> dict[str, Any]:
    return {
        "state": "starting",
        "restarts": 0,
        "launch_failures": 0,
        "launch_at": None,
        "down_since": None,
        "next_attempt_at": None,
        "hold_reason": None,
        "breaker_open_since": None,
        "breaker_reset_at": 0.0,
        "history": [],
    }


class Supervisor:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.state_dir: Path = args.state_dir
        self.path = self.state_dir / "supervisor.json"
        self.lock = self.state_dir / "supervisor.lock"
        self.values = {"unit": args.unit, "container": args.container}
        self.kinds = set(args.breaker_kinds.split(","))
        self.alerter = Alerter(self.state_dir, min_interval_s=args.alert_min_interval_s)

    # -- state -------------------------------------------------------------------------------
    def load(self) -> dict[str, Any]:
        state = fresh_state()
        state.update({k: v for k, v in read_json_object(self.path).items() if k in state})
        return state

    def save(self, st: dict[str, Any], now: float) -> None:
        st["updated"] = now
        st["updated_iso"] = iso(now)
        st["settings"] = {
            "backoff_base_s": self.args.backoff_base_s,
            "backoff_cap_s": self.args.backoff_cap_s,
            "stable_s": self.args.stable_s,
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
        return min(self.args.backoff_base_s * 2**restarts, self.args.backoff_cap_s)

    def running(self) -> bool:
        return run_command(self.args.check_cmd, self.values, timeout_s=60).ok

    def incidents(self, st: dict[str, Any], now: float) -> list[dict[str, Any]]:
        since = max(now - self.args.breaker_window_s, float(st["breaker_reset_at"] or 0.0))
        return read_markers(self.state_dir, self.kinds, since)

    # -- the loop ----------------------------------------------------------------------------
    def tick(self) -> dict[str, Any]:
        with locked(self.lock):
            now = time.time()
            st = self.load()
            self.step(st, now)
            self.save(st, now)
            return st

    def step(self, st: dict[str, Any], now: float) -> None:
        args = self.args
        if manual_stop_path(self.state_dir).exists():
            if st["state"] != "manual-stop":
                self.record(st, now, "manual-stop", note="flag present; not relaunching")
            st.update(state="manual-stop", restarts=0, launch_at=None, down_since=None)
            st.update(next_attempt_at=None)
            return
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
            return
        if st["hold_reason"] is not None:
            st.update(state="hold", next_attempt_at=None)
            return

        if self.running():
            if st["launch_at"] is not None and now - st["launch_at"] >= args.stable_s:
                self.record(st, now, "stable", after_s=round(now - st["launch_at"], 1))
                st.update(launch_at=None, restarts=0, launch_failures=0)
            st.update(state="running", down_since=None, next_attempt_at=None)
            return

        # The service is down.
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
            st["launch_at"] = None
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

    def launch(self, st: dict[str, Any], now: float) -> None:
        waited = round(now - st["down_since"], 2)
        result = run_command(self.args.start_cmd, self.values, timeout_s=self.args.start_timeout_s)
        st["restarts"] += 1
        if result.ok:
            self.record(st, now, "relaunch", attempt=st["restarts"], waited_s=waited)
            st.update(state="launched", launch_at=now, down_since=None, next_attempt_at=None)
            return
        failed = {"attempt": st["restarts"], "waited_s": waited, "exit": result.returncode}
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
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        log(
            f"supervising {self.args.unit}: backoff {self.args.backoff_base_s:g} s x 2^n "
            f"(cap {self.args.backoff_cap_s:g} s), hold after {self.args.hold_after}, breaker "
            f"at {self.args.breaker_count} in {self.args.breaker_window_s:g} s"
        )
        while not stop.is_set():
            self.tick()
            stop.wait(self.args.poll_s)
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
                down_since=None,
                next_attempt_at=None,
                state="reset",
            )
            self.record(st, now, "reset", note="breaker closed, hold cleared")
            self.save(st, now)
        return 0

    def relaunch(self) -> int:
        """Drain, then stop and start in one locked step, so the loop never sees it down."""
        st = self.load()
        if manual_stop_path(self.state_dir).exists() or st["state"] in ("hold", "breaker-open"):
            log(f"maintenance relaunch skipped: supervisor is {st['state']}")
            return 0
        if not self.running():
            log("maintenance relaunch skipped: the service is not running")
            return 0
        drained = self.drain()
        with locked(self.lock):
            now = time.time()
            st = self.load()
            stop = run_command(self.args.stop_cmd, self.values, timeout_s=self.args.stop_timeout_s)
            start = run_command(
                self.args.start_cmd, self.values, timeout_s=self.args.start_timeout_s
            )
            self.record(
                st,
                now,
                "maintenance-relaunch",
                drained=drained,
                stop_exit=stop.returncode,
                start_exit=start.returncode,
            )
            if start.ok:
                st.update(state="launched", launch_at=now)
            self.save(st, now)
        return 0 if stop.ok and start.ok else 1

    def drain(self) -> bool:
        """Wait until the engine reports no running or waiting request (or time runs out)."""
        if not self.args.drain_metrics_url:
            return False
        deadline = time.monotonic() + self.args.drain_timeout_s
        while time.monotonic() < deadline:
            busy = requests_in_flight(self.args.drain_metrics_url)
            if busy is None:
                log("drain: engine metrics unreadable; relaunching without draining")
                return False
            if busy == 0:
                return True
            time.sleep(min(5.0, max(0.1, deadline - time.monotonic())))
        log(f"drain: still busy after {self.args.drain_timeout_s:g} s; relaunching anyway")
        return False


def requests_in_flight(url: str) -> float | None:
    """Sum of vLLM's running and waiting request gauges from its Prometheus endpoint."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode("utf-8", "replace")
    except OSError:
        return None
    total, seen = 0.0, False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            try:
                total += float(line.rsplit(" ", 1)[1])
                seen = True
            except (IndexError, ValueError):
                continue
    return total if seen else None


def status(state_dir: Path, as_json: bool) -> int:
    now = time.time()
    report = {
        "manual_stop": manual_stop_path(state_dir).exists(),
        "supervisor": read_json(state_dir / "supervisor.json", None),
        "watchdog": read_json(state_dir / "watchdog.json", None),
        "probe": read_json(state_dir / "probe.json", None),
        "incidents_24h": [
            {k: m.get(k) for k in ("kind", "time_iso", "reason", "path")}
            for m in read_markers(state_dir, INCIDENT_KINDS, now - 86400)
        ],
    }
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    sup = report["supervisor"] or {}
    wd = report["watchdog"] or {}
    probe = report["probe"] or {}
    mib = 1024 * 1024
    lines = [
        f"supervisor: {sup.get('state', 'unknown')}"
        + (f" (hold: {sup['hold_reason']})" if sup.get("hold_reason") else "")
        + (" (manual stop)" if report["manual_stop"] else ""),
        f"  restarts in streak {sup.get('restarts', 0)}, failed launches "
        f"{sup.get('launch_failures', 0)}, next attempt {iso_or_dash(sup.get('next_attempt_at'))}",
        f"watchdog: MemAvailable {wd.get('mem_available_bytes', 0) // mib} MiB, MemFree "
        f"{wd.get('mem_free_bytes', 0) // mib} MiB, trips {wd.get('trips', 0)}, "
        f"updated {iso_or_dash(wd.get('updated'))}",
        f"probe: {probe.get('last_result', 'unknown')}, consecutive failures "
        f"{probe.get('consecutive_failures', 0)}, last ok {iso_or_dash(probe.get('last_ok'))}",
        f"incidents in 24 h: {len(report['incidents_24h'])}",
    ]
    lines += [f"  {m['time_iso']} {m['kind']}: {m['reason']}" for m in report["incidents_24h"]]
    print("\n".join(lines))
    return 0


def iso_or_dash(t: Any) -> str:
    return iso(t) if isinstance(t, int | float) else "-"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state-dir", type=Path, required=True, help="markers and state (shared)")
    service = argparse.ArgumentParser(add_help=False)
    service.add_argument("--unit", default="sparkple-vllm.service", help="unit name ({unit})")
    service.add_argument("--container", default="sparkple-vllm", help="container ({container})")
    service.add_argument("--check-cmd", default="systemctl is-active --quiet {unit}")
    service.add_argument("--start-cmd", default="systemctl start {unit}")
    service.add_argument("--stop-cmd", default="systemctl stop {unit}")
    service.add_argument("--start-timeout-s", type=float, default=300.0)
    service.add_argument("--stop-timeout-s", type=float, default=180.0)
    service.add_argument("--alert-min-interval-s", type=float, default=900.0)
    policy = argparse.ArgumentParser(add_help=False)
    policy.add_argument("--poll-s", type=float, default=5.0, help="seconds between checks")
    policy.add_argument("--backoff-base-s", type=float, default=30.0, help="first relaunch delay")
    policy.add_argument("--backoff-cap-s", type=float, default=900.0, help="longest delay")
    policy.add_argument("--stable-s", type=float, default=600.0, help="uptime that resets n")
    policy.add_argument("--hold-after", type=int, default=5, help="failed launches in a row")
    policy.add_argument("--breaker-count", type=int, default=3, help="incidents that open it")
    policy.add_argument("--breaker-window-s", type=float, default=7200.0, help="within this")
    policy.add_argument(
        "--breaker-kinds", default="emergency", help="marker kinds counted, comma-separated"
    )
    drain = argparse.ArgumentParser(add_help=False)
    drain.add_argument("--drain-metrics-url", default="", help="vLLM /metrics; empty: no drain")
    drain.add_argument("--drain-timeout-s", type=float, default=600.0)

    sub.add_parser("run", parents=[common, service, policy], help="the supervision loop")
    sub.add_parser("status", parents=[common], help="print state").add_argument(
        "--json", action="store_true"
    )
    sub.add_parser("reset", parents=[common, service, policy], help="close breaker, clear hold")
    sub.add_parser("manual-stop", parents=[common], help="set the manual-stop flag")
    sub.add_parser("resume", parents=[common], help="remove the manual-stop flag")
    sub.add_parser("relaunch", parents=[common, service, policy, drain], help="drain, stop, start")
    args = p.parse_args(argv)
    if args.command in ("run", "reset", "relaunch") and (
        args.backoff_base_s <= 0 or args.hold_after < 1 or args.breaker_count < 1
    ):
        p.error("--backoff-base-s must be > 0, --hold-after and --breaker-count >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "status":
        return status(args.state_dir, args.json)
    if args.command == "manual-stop":
        args.state_dir.mkdir(parents=True, exist_ok=True)
        manual_stop_path(args.state_dir).write_text(f"set {iso(time.time())}\n")
        return 0
    if args.command == "resume":
        manual_stop_path(args.state_dir).unlink(missing_ok=True)
        return 0
    supervisor = Supervisor(args)
    if args.command == "reset":
        return supervisor.reset()
    if args.command == "relaunch":
        code = supervisor.relaunch()
        supervisor.alerter.drain()
        return code
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
