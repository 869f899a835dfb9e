"""Supervisor: relaunch the serving unit with backoff, and know when to stop trying.

The serving unit has no restart policy of its own; this loop owns relaunching it:
  - a down service is relaunched after base x 2^n seconds (n: launches since the service was
    last healthy for `stable_s`), capped; shared memory that no live process holds is removed
    before every relaunch (a killed engine leaves it in /dev/shm under --ipc host);
  - a launch must pass /health within `ready_timeout_s` (a cold start takes about 11 min);
    one that does not is stopped, counted as a failed launch and alerted;
  - "stable" means /health answered 200 without a miss for `stable_s`, not merely "up";
  - after `hold_after` consecutive failed launches (the start command fails, the service
    exits before it is stable without an incident marker explaining it, or it never gets
    ready) it holds;
  - after `breaker_count` incidents (watchdog emergency markers) within `breaker_window_s` the
    circuit breaker opens: a host that keeps running out of memory needs a person, not retries;
  - the manual-stop flag (written by the stop playbook, a rollout or `manual-stop`) means hands
    off; `manual-stop` and `resume` take the loop's lock, so no check in progress misses it.
Hold and breaker latch until `reset`. State is in <state-dir>/supervisor.json; `status` prints
it together with the watchdog's and the probe's state.

Subcommands: run, status, reset, manual-stop, resume, relaunch (drain, then stop and start,
wait for /health and check a real generation: the weekly maintenance relaunch).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ..atomicfile import write_text
from .alert import Alerter
from .host import KMSG, block_device, kernel_error_counts, run_command, service_options
from .probe import Client, check_generation, read_env_file
from .shm import DEFAULT_PATTERNS, clean_unheld
from .state import (
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
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.state_dir: Path = args.state_dir
        self.path = self.state_dir / "supervisor.json"
        self.lock = self.state_dir / "supervisor.lock"
        self.values = {"unit": args.unit, "container": args.container}
        self.kinds = set(args.breaker_kinds.split(","))
        self.alerter = Alerter(self.state_dir, min_interval_s=args.alert_min_interval_s)
        self.table_device = table_device(args)

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
        return min(self.args.backoff_base_s * 2**restarts, self.args.backoff_cap_s)

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
            st["table_device"] = self.table_device  # for `status` run without --table-dir
            self.step(st, now)
            self.heartbeat(st, now)
            self.save(st, now)
            return st

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

    def step(self, st: dict[str, Any], now: float) -> None:
        args = self.args
        if manual_stop_path(self.state_dir).exists():
            if st["state"] != "manual-stop":
                self.record(st, now, "manual-stop", note="flag present; not relaunching")
            st.update(state="manual-stop", restarts=0, launch_at=None, down_since=None)
            st.update(next_attempt_at=None, ready_at=None, healthy_since=None)
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
                ready_at=None,
                healthy_since=None,
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
                st.update(state="launched", launch_at=now, ready_at=None, healthy_since=None)
            self.save(st, now)
        if not (stop.ok and start.ok):
            return 1
        return self.smoke(now)

    def smoke(self, launched: float) -> int:
        """After a maintenance relaunch: wait for /health, then ask for a real generation."""
        if not self.args.url:
            return 0
        deadline = launched + self.args.ready_timeout_s
        while not self.healthy() and time.time() < deadline:
            time.sleep(min(self.args.poll_s, max(0.0, deadline - time.time())))
        ready = self.healthy()
        if ready:
            ok, detail = check_generation(
                self.client(), self.args.model, self.args.generation_timeout_s
            )
        else:
            ok, detail = False, f"/health not 200 within {self.args.ready_timeout_s:g} s"
        with locked(self.lock):
            now = time.time()
            st = self.load()
            self.record(st, now, "maintenance-smoke", ok=ok, detail=detail)
            self.save(st, now)
        if not ok:
            self.alerter.send(
                "relaunch-smoke-failed", f"weekly relaunch: smoke generation failed: {detail}"
            )
        return 0 if ok else 1

    def client(self) -> Client:
        key = ""
        if self.args.api_key_file:
            key = read_env_file(self.args.api_key_file, self.args.api_key_var)
        return Client(self.args.url, key)

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


def http_status(url: str, timeout_s: float) -> int:
    """The HTTP status of a GET (0 when no answer came)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            response.read(1024)
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return 0


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


def table_device(args: argparse.Namespace) -> str:
    """--table-device, else the block device under --table-dir ("" when neither tells)."""
    if getattr(args, "table_device", ""):
        return str(args.table_device)
    table_dir = getattr(args, "table_dir", None)
    if table_dir is None:
        return ""
    try:
        return block_device(table_dir) or ""
    except OSError:
        return ""


def report(state_dir: Path, kmsg: Path, io_device: str = "") -> dict[str, Any]:
    now = time.time()
    sup = read_json(state_dir / "supervisor.json", None)
    if not io_device and isinstance(sup, dict):
        io_device = sup.get("table_device") or ""  # the one the supervisor's loop watches
    return {
        "manual_stop": manual_stop_path(state_dir).exists(),
        "supervisor": read_json(state_dir / "supervisor.json", None),
        "watchdog": read_json(state_dir / "watchdog.json", None),
        "probe": read_json(state_dir / "probe.json", None),
        "incidents_24h": [
            {k: m.get(k) for k in ("kind", "time_iso", "reason", "path")}
            for m in read_markers(state_dir, INCIDENT_KINDS, now - 86400)
        ],
        "kernel_errors": kernel_error_counts(kmsg, io_device),
        "table_device": io_device or None,
    }


def kernel_line(errors: dict[str, int] | None, device: str | None = None) -> str:
    if errors is None:
        return "kernel log: unreadable"
    line = f"kernel log: Xid {errors['xid']}, NV_ERR_NO_MEMORY {errors['nv_err_no_memory']}"
    if "table_io" in errors:
        line += f", table I/O errors {errors['table_io']} ({device})"
    return line


def one_line(rep: dict[str, Any]) -> str:
    """The status in one line (the daily heartbeat's text)."""
    sup = rep["supervisor"] or {}
    probe = rep["probe"] or {}
    wd = rep["watchdog"] or {}
    return (
        f"supervisor {sup.get('state', 'unknown')}"
        + (" (manual stop)" if rep["manual_stop"] else "")
        + f", probe {probe.get('last_result', 'unknown')}, incidents in 24 h "
        f"{len(rep['incidents_24h'])}, MemAvailable "
        f"{wd.get('mem_available_bytes', 0) // (1024 * 1024)} MiB, "
        + kernel_line(rep["kernel_errors"], rep.get("table_device"))
    )


def status(state_dir: Path, as_json: bool, kmsg: Path, io_device: str = "") -> int:
    rep = report(state_dir, kmsg, io_device)
    if as_json:
        print(json.dumps(rep, indent=2, sort_keys=True))
        return 0
    sup = rep["supervisor"] or {}
    wd = rep["watchdog"] or {}
    probe = rep["probe"] or {}
    mib = 1024 * 1024
    lines = [
        f"supervisor: {sup.get('state', 'unknown')}"
        + (f" (hold: {sup['hold_reason']})" if sup.get("hold_reason") else "")
        + (" (manual stop)" if rep["manual_stop"] else ""),
        f"  restarts in streak {sup.get('restarts', 0)}, failed launches "
        f"{sup.get('launch_failures', 0)}, next attempt {iso_or_dash(sup.get('next_attempt_at'))}",
        f"watchdog: MemAvailable {wd.get('mem_available_bytes', 0) // mib} MiB, MemFree "
        f"{wd.get('mem_free_bytes', 0) // mib} MiB, trips {wd.get('trips', 0)}, "
        f"updated {iso_or_dash(wd.get('updated'))}",
        f"probe: {probe.get('last_result', 'unknown')}, consecutive failures "
        f"{probe.get('consecutive_failures', 0)}, last ok {iso_or_dash(probe.get('last_ok'))}",
        kernel_line(rep["kernel_errors"], rep.get("table_device")),
        f"incidents in 24 h: {len(rep['incidents_24h'])}",
    ]
    lines += [f"  {m['time_iso']} {m['kind']}: {m['reason']}" for m in rep["incidents_24h"]]
    print("\n".join(lines))
    return 0


def iso_or_dash(t: Any) -> str:
    return iso(t) if isinstance(t, int | float) else "-"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state-dir", type=Path, required=True, help="markers and state (shared)")
    common.add_argument("--kmsg", type=Path, default=KMSG, help="kernel log (Xid counts)")
    common.add_argument(
        "--table-dir", type=Path, help="the published PLE table (I/O errors on its device)"
    )
    common.add_argument("--table-device", default="", help="its block device; default: found")
    service = argparse.ArgumentParser(add_help=False, parents=[service_options()])
    service.add_argument("--check-cmd", default="systemctl is-active --quiet {unit}")
    service.add_argument("--start-cmd", default="systemctl start {unit}")
    service.add_argument("--stop-cmd", default="systemctl stop {unit}")
    service.add_argument("--start-timeout-s", type=float, default=300.0)
    service.add_argument("--stop-timeout-s", type=float, default=180.0)
    service.add_argument(
        "--url", default="", help="the server's base URL (/health); empty: up means ready"
    )
    service.add_argument("--health-timeout-s", type=float, default=5.0)
    service.add_argument("--model", default="", help="model for the smoke generation")
    service.add_argument("--api-key-file", type=Path, help="env file holding the API key")
    service.add_argument("--api-key-var", default="VLLM_API_KEY", help="its variable name")
    service.add_argument("--generation-timeout-s", type=float, default=120.0)
    service.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    service.add_argument(
        "--shm-patterns",
        default=DEFAULT_PATTERNS,
        help="segments removed before a relaunch when no process holds any; empty: none",
    )
    policy = argparse.ArgumentParser(add_help=False)
    policy.add_argument("--poll-s", type=float, default=5.0, help="seconds between checks")
    policy.add_argument("--backoff-base-s", type=float, default=30.0, help="first relaunch delay")
    policy.add_argument("--backoff-cap-s", type=float, default=900.0, help="longest delay")
    policy.add_argument("--stable-s", type=float, default=600.0, help="healthy time that resets n")
    policy.add_argument(
        "--ready-timeout-s",
        type=float,
        default=1800.0,
        help="a launch must pass /health within this, or it is stopped and counted",
    )
    policy.add_argument(
        "--heartbeat-s", type=float, default=0.0, help="alert a status line this often; 0: off"
    )
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
    sub.add_parser("manual-stop", parents=[common], help="set the manual-stop flag").add_argument(
        "--reason", default="operator", help="who set it (shown by status)"
    )
    sub.add_parser("resume", parents=[common], help="remove the manual-stop flag")
    sub.add_parser("relaunch", parents=[common, service, policy, drain], help="drain, stop, start")
    args = p.parse_args(argv)
    if args.command in ("run", "reset", "relaunch") and (
        args.backoff_base_s <= 0
        or args.hold_after < 1
        or args.breaker_count < 1
        or args.ready_timeout_s <= 0
        or args.heartbeat_s < 0
    ):
        p.error(
            "--backoff-base-s and --ready-timeout-s must be > 0, --heartbeat-s >= 0, "
            "--hold-after and --breaker-count >= 1"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "status":
        return status(args.state_dir, args.json, args.kmsg, table_device(args))
    if args.command in ("manual-stop", "resume"):
        # Under the loop's lock: a check in progress finishes first, the next one sees the flag.
        with locked(args.state_dir / "supervisor.lock"):
            if args.command == "manual-stop":
                write_text(
                    manual_stop_path(args.state_dir), f"set {iso(time.time())} by {args.reason}\n"
                )
            else:
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
