"""The supervisor program on a node of a pair (two Sparks at TP 2): a single Spark's subcommands
(sparkple.supervise.supervisor_cli) with the pair's flags, run by the head's supervisor or the
worker's.

The pair is one unit of service (sparkple.pair.member): each node's supervisor serves its side
read-only on the pair link (GET http://<--pair-listen>/pair) and reads the other's
(--pair-peer-url). The head's supervisor (sparkple.pair.leader) leads and applies the single
Spark's policy to the pair: the worker's unit starts first, a break of either side stops the
other and counts one `pair-broken` incident (the only kind its breaker counts), and both are
relaunched together. The worker's supervisor (sparkple.pair.follower) follows the head and counts
nothing; the manual-stop flag of either node is hands off for both.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from ..supervise import supervisor_cli
from ..supervise.supervisor import Supervisor
from .follower import PairFollower
from .leader import PairLeader
from .pairlink import parse_listen, read_key


def pair_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    pair = p.add_argument_group("a pair (two Sparks at TP 2)")
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
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = supervisor_cli.build_parser([pair_options()])
    args = p.parse_args(argv)
    supervisor_cli.check(p, args)
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


def make_supervisor(args: argparse.Namespace) -> Supervisor:
    """The node's supervisor: --pair-rank 0 leads, 1 follows; without it, a single Spark's
    (`sparkple-ops reset` on a pair's node runs without the pair's flags)."""
    if args.pair_rank is None:
        return Supervisor(args)
    return PairLeader(args) if args.pair_rank == 0 else PairFollower(args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if getattr(args, "pair_rank", None) is not None:
        try:
            read_key(args.pair_key_file)  # here, not in parse_args: the flags parse anywhere
        except ValueError as exc:
            print(f"ple-supervisor: error: {args.pair_host}: {exc}", file=sys.stderr)
            return 2
    return supervisor_cli.run(args, make_supervisor)


if __name__ == "__main__":
    sys.exit(main())
