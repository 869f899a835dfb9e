"""The weekly maintenance relaunch (`supervisor relaunch`): drain, then stop and start under the
supervisor's lock, so its loop never sees the service down; then wait for /health and ask for
a real generation."""

from __future__ import annotations

import argparse
import time

from .drain import drain
from .probe import Client, check_generation, read_env_file
from .state import locked, manual_stop_path
from .supervisor import Supervisor, log


def relaunch(sup: Supervisor) -> int:
    """Drain, then stop and start in one locked step, so the loop never sees it down."""
    if sup.pair_role == "worker":
        log("maintenance relaunch skipped: the head's relaunch relaunches the pair, worker first")
        return 0
    st = sup.load()
    # a pair's loop is hands off under the peer's manual-stop flag as well (state manual-stop)
    paused = ("hold", "breaker-open") + (("manual-stop",) if sup.pair_role else ())
    if manual_stop_path(sup.state_dir).exists() or st["state"] in paused:
        log(f"maintenance relaunch skipped: supervisor is {st['state']}")
        return 0
    if not sup.running():
        log("maintenance relaunch skipped: the service is not running")
        return 0
    drained = drain(sup.args.drain_metrics_url, sup.args.drain_timeout_s, log)
    with locked(sup.lock):
        now = time.time()
        st = sup.load()
        ok, exits = sup.restart_unit(st, now)
        sup.record(st, now, "maintenance-relaunch", drained=drained, **exits)
        sup.save(st, now)
    if not ok:
        return 1
    return smoke(sup, now)


def smoke(sup: Supervisor, launched: float) -> int:
    """After a maintenance relaunch: wait for /health, then ask for a real generation."""
    if not sup.args.url:
        return 0
    deadline = launched + sup.args.ready_timeout_s
    while not sup.healthy() and time.time() < deadline:
        time.sleep(min(sup.args.poll_s, max(0.0, deadline - time.time())))
    ready = sup.healthy()
    if ready:
        ok, detail = check_generation(
            client(sup.args), sup.args.model, sup.args.generation_timeout_s
        )
    else:
        ok, detail = False, f"/health not 200 within {sup.args.ready_timeout_s:g} s"
    with locked(sup.lock):
        now = time.time()
        st = sup.load()
        sup.record(st, now, "maintenance-smoke", ok=ok, detail=detail)
        sup.save(st, now)
    if not ok:
        sup.alerter.send(
            "relaunch-smoke-failed", f"weekly relaunch: smoke generation failed: {detail}"
        )
    return 0 if ok else 1


def client(args: argparse.Namespace) -> Client:
    key = ""
    if args.api_key_file:
        key = read_env_file(args.api_key_file, args.api_key_var)
    return Client(args.url, key)
