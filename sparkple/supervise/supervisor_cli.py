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

On the two nodes of a pair (two Sparks at TP 2, `--pair-rank`) the pair is one unit of service
(sparkple.ops.pairing): each node's supervisor serves its side read-only on the pair link
(GET http://<--pair-listen>/pair) and reads the other's (--pair-peer-url). The head's supervisor
leads and applies the policy above to the pair: the worker's unit starts first, a break of
either side stops the other and counts one `pair-broken` incident (the only kind its breaker
counts), and both are relaunched together. The worker's supervisor follows the head and counts
nothing; the manual-stop flag of either node is hands off for both.

Subcommands: run, status, reset, manual-stop, resume, relaunch (drain, then stop and start,
wait for /health and check a real generation: the weekly maintenance relaunch), incident
(record one incident marker of a kind written outside the loop: a rollout's rollback), drain
(the rollout's wait for an idle engine, by the relaunch's rule: sparkple.ops.drain).
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

from ..atomicfile import write_text
from .drain import drain_command, drain_options
from .host import service_options, table_device
from .maintenance import relaunch
from .pair_head import PairLeader
from .pair_worker import PairFollower
from .pairlink import parse_listen, read_key
from .shm import DEFAULT_PATTERNS
from .state import ROLLBACK, iso, locked, manual_stop_path, write_marker
from .status import state_options, status
from .supervision import Supervisor


def make_supervisor(args: argparse.Namespace) -> Supervisor:
    """The single Spark's supervisor, or a pair node's (--pair-rank 0: leads; 1: follows)."""
    if getattr(args, "pair_rank", None) is None:
        return Supervisor(args)
    return PairLeader(args) if args.pair_rank == 0 else PairFollower(args)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = state_options()
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
    pair = service.add_argument_group("a pair (two Sparks at TP 2)")
    pair.add_argument("--pair", default="", help="the pair's name (the same on both nodes)")
    pair.add_argument(
        "--pair-rank", type=int, choices=(0, 1), help="0: the head (leads), 1: the worker"
    )
    pair.add_argument("--pair-host", default=socket.gethostname(), help="this node's name")
    pair.add_argument("--pair-listen", default="", help="ADDRESS:PORT of this node's pair link")
    pair.add_argument("--pair-peer-url", default="", help="the peer's link, http://ADDRESS:PORT")
    pair.add_argument(
        "--pair-key-file",
        type=Path,
        help="the pair's shared key (the same on both nodes): authenticates the pair link",
    )
    pair.add_argument(
        "--boot-marker",
        type=Path,
        default=Path("/run/sparkple/supervisor-boot"),
        help="this boot's token, on a tmpfs: a new one is a boot (the pair relaunched in order)",
    )
    pair.add_argument(
        "--release-file",
        type=Path,
        help="this node's current release.json: its id and patch manifest travel on /pair",
    )
    pair.add_argument(
        "--pair-peer-timeout-s",
        type=float,
        default=30.0,
        help="a peer unreachable this long is gone: its side of the pair is stopped",
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
    args = p.parse_args(argv)
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
    if getattr(args, "pair_rank", None) is not None:
        try:
            parse_listen(args.pair_listen)
        except ValueError as exc:
            p.error(str(exc))
        if not args.pair or not args.pair_peer_url.startswith(("http://", "https://")):
            p.error(
                "--pair-rank needs --pair NAME and --pair-peer-url http://PEER:PORT "
                "(roles/serving_supervisor renders them from sparkple_pair_info)"
            )
        if args.pair_peer_timeout_s <= 0:
            p.error("--pair-peer-timeout-s must be > 0")
        if args.pair_key_file is None:
            p.error(
                f"{args.pair_host}: --pair-rank needs --pair-key-file: the pair link is "
                "authenticated; set serving_supervisor_pair_key in the inventory's vault"
            )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
    if getattr(args, "pair_rank", None) is not None:
        try:
            read_key(args.pair_key_file)  # here, not in parse_args: the flags parse anywhere
        except ValueError as exc:
            print(f"ple-supervisor: error: {args.pair_host}: {exc}", file=sys.stderr)
            return 2
    supervisor = make_supervisor(args)
    if args.command == "reset":
        return supervisor.reset()
    if args.command == "relaunch":
        code = relaunch(supervisor)
        supervisor.alerter.drain()
        return code
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
