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

A pair's node runs the same subcommands with the pair's flags from sparkple.pair.supervisor_cli
(its supervisors, sparkple.pair.leader and sparkple.pair.follower, extend this one's loop).

Subcommands: run, status, reset, manual-stop, resume, relaunch (drain, then stop and start,
wait for /health and check a real generation: the weekly maintenance relaunch), incident
(record one incident marker of a kind written outside the loop: a rollout's rollback), drain
(the rollout's wait for an idle engine, by the relaunch's rule: sparkple.supervise.drain).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..atomicfile import write_text
from .commands import service_options
from .devices import table_device
from .drain import drain_command, drain_options
from .maintenance import relaunch
from .shm import DEFAULT_PATTERNS
from .state import ROLLBACK, iso, locked, manual_stop_path, write_marker
from .status import state_options, status
from .supervisor import Supervisor


def build_parser(node: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
    """The subcommands and their flags; `node`: parsers of flags added to the service's (a
    pair node's)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = state_options()
    service = argparse.ArgumentParser(add_help=False, parents=[service_options(), *node])
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

    sub.add_parser("run", parents=[common, service, policy], help="the supervision loop")
    sub.add_parser("status", parents=[common], help="print state").add_argument(
        "--json", action="store_true"
    )
    sub.add_parser("reset", parents=[common, service, policy], help="close breaker, clear hold")
    sub.add_parser("manual-stop", parents=[common], help="set the manual-stop flag").add_argument(
        "--reason", default="operator", help="who set it (shown by status)"
    )
    sub.add_parser("resume", parents=[common], help="remove the manual-stop flag")
    incident = sub.add_parser("incident", parents=[common], help="record an incident marker")
    incident.add_argument("--kind", required=True, choices=[ROLLBACK])
    incident.add_argument("--reason", required=True, help="what happened (shown by status)")
    sub.add_parser(
        "relaunch", parents=[common, service, policy, drain_options()], help="drain, stop, start"
    )
    drain = sub.add_parser("drain", help="wait until the engine runs and queues no request")
    drain.add_argument("--metrics-url", required=True, help="vLLM's /metrics")
    drain.add_argument("--timeout-s", type=float, required=True, help="give up (exit 1) after")
    drain.add_argument("--poll-s", type=float, default=5.0, help="between reads")
    return p


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what the flags cannot mean (p.error exits 2)."""
    if args.command == "drain" and (args.timeout_s < 0 or args.poll_s <= 0):
        p.error("--timeout-s must be >= 0 and --poll-s > 0")
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    check(p, args)
    return args


def run(args: argparse.Namespace, make: Callable[[argparse.Namespace], Supervisor]) -> int:
    """Run the subcommand; `make` builds the supervisor of run, reset and relaunch."""
    if args.command == "drain":
        return drain_command(args.metrics_url, args.timeout_s, args.poll_s)
    if args.command == "status":
        return status(args.state_dir, args.json, args.kmsg, table_device(args), args.table_dir)
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
    if args.command == "incident":
        print(write_marker(args.state_dir, args.kind, time.time(), {"reason": args.reason}))
        return 0
    supervisor = make(args)
    if args.command == "reset":
        return supervisor.reset()
    if args.command == "relaunch":
        code = relaunch(supervisor)
        supervisor.alerter.drain()
        return code
    return supervisor.run()


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv), Supervisor)


if __name__ == "__main__":
    sys.exit(main())
