"""`sparkple pair-link-check` (a pair node's link before it starts: preflight and the unit's
ExecStartPre) and `sparkple pair-transport` (the head reads NCCL's init lines in its unit's
journal and refuses, or warns, when the pair is not on the transport it should be)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..atomicfile import write_text
from ..errors import EXIT_CHECK_FAILED, EXIT_OK
from ..serving.recipe import ServingError
from .link import (
    DEFAULT_MTU,
    PEER_TIMEOUT_S,
    TRANSPORTS,
    LinkSpec,
    check_link,
    ib_devices,
    ip_addresses,
    nccl_networks,
    nccl_transport,
    parse_ip_json,
)


def _check_cmd(args: argparse.Namespace) -> int:
    spec = LinkSpec(
        host=args.host,
        interface=args.interface,
        address=args.address,
        peer_address=args.peer_address,
        peer_port=args.peer_port,
        mtu=args.mtu,
        transport=args.transport,
        ib_hca=args.ib_hca,
        gid_index=args.gid_index,
    )
    addresses: Callable[[str], list[str]] = ip_addresses
    if args.ip_json:
        saved = parse_ip_json(Path(args.ip_json).read_text())

        def addresses(_interface: str) -> list[str]:  # the saved `ip -j` output
            return saved

    report = check_link(spec, Path(args.root), addresses, timeout_s=args.timeout)
    if args.json:
        print(json.dumps({"ok": not report.failures, "failures": report.failures,
                          "passed": report.passed, "env": report.env()}))  # fmt: skip
    if report.failures:
        if not args.json:
            print(f"sparkple pair-link-check: {'; '.join(report.failures)}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    if args.env_file:
        # what `docker run --env-file` adds to the inventory's env: found now, not at deploy
        lines = [f"# sparkple pair-link-check, {args.host}: {'; '.join(report.passed)}"]
        lines += [f"{k}={v}" for k, v in report.env().items()]
        write_text(Path(args.env_file), "\n".join(lines) + "\n", durable=False)
    if not args.json:
        print(f"sparkple pair-link-check: {args.host}: {'; '.join(report.passed)}")
    return EXIT_OK


def unit_log(unit: str) -> list[str]:
    """The unit's journal since its main process last started (this run's NCCL lines only)."""
    since = subprocess.run(
        ["systemctl", "show", "--timestamp=unix", "--property=ExecMainStartTimestamp",
         "--value", unit], capture_output=True, text=True, timeout=30, check=False,
    ).stdout.strip()  # fmt: skip
    if not since.startswith("@"):
        raise ServingError(f"{unit} has not started (systemctl shows no start time)")
    run = subprocess.run(
        ["journalctl", "--unit", unit, "--since", since, "--output", "cat", "--no-pager"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if run.returncode != 0:
        raise ServingError(f"journalctl --unit {unit} failed: {run.stderr.strip()}")
    return run.stdout.splitlines()


def transport_verdict(lines: list[str], expect: str, where: str) -> tuple[bool, str]:
    """Whether NCCL's init lines show the expected transport, and the sentence saying so."""
    found = nccl_transport(lines)
    if found is None:
        return False, (
            f"{where}: no NCCL 'Using network' line since the engine started, so the transport "
            "is unknown: the unit sets NCCL_DEBUG=INFO and NCCL_DEBUG_SUBSYS=INIT,NET; check that "
            "vllm_service_extra_env does not override them and that the pair has formed"
        )
    networks = ", ".join(nccl_networks(lines))
    if found == expect:
        devices = ib_devices(lines)
        return True, f"{where}: NCCL uses {networks}" + (f" ({devices})" if devices else "")
    fix = (
        "the pair runs on TCP sockets, about half the decode speed: check /dev/infiniband in "
        "the container, sparkple_pair_ib_hca and the image's verbs libraries (ibv_devinfo), "
        "or choose sparkple_pair_transport: socket explicitly"
        if expect == "ib"
        else "set sparkple_pair_transport: ib to use RDMA"
    )
    return False, f"{where}: NCCL uses {networks}, not {expect}: {fix}"


def _transport_cmd(args: argparse.Namespace) -> int:
    if args.log:
        lines = Path(args.log).read_text(errors="replace").splitlines()
        where = f"{args.host} ({args.log})"
    else:
        lines = unit_log(args.unit)
        where = f"{args.host} ({args.unit})"
    ok, message = transport_verdict(lines, args.expect, where)
    if ok:
        print(f"sparkple pair-transport: {message}")
        return EXIT_OK
    if args.on_mismatch == "warn":
        print(f"sparkple pair-transport: WARNING: {message}", file=sys.stderr)
        return EXIT_OK
    print(f"sparkple pair-transport: {message}", file=sys.stderr)
    return EXIT_CHECK_FAILED


def add_parser(sub: Any, name: str) -> None:
    if name == "pair-link-check":
        p = sub.add_parser(name, help="check a pair node's link before it starts")
        p.add_argument("--host", required=True, help="this node's inventory name (in messages)")
        p.add_argument("--interface", required=True, help="the link's netdev")
        p.add_argument("--address", required=True, help="this node's link address")
        p.add_argument("--peer-address", required=True, help="the peer's link address")
        p.add_argument("--peer-port", type=int, required=True, help="a TCP port on the peer")
        p.add_argument("--mtu", type=int, default=DEFAULT_MTU, help="the link's expected MTU")
        p.add_argument("--transport", choices=TRANSPORTS, default="ib")
        p.add_argument("--ib-hca", default="", help="NCCL_IB_HCA (the link's RDMA devices)")
        p.add_argument("--gid-index", type=int, help="a pinned NCCL_IB_GID_INDEX to verify")
        p.add_argument("--root", default="/", help="where /sys and /proc are read (tests)")
        p.add_argument("--ip-json", default="", help="saved `ip -j -4 addr` output to read")
        p.add_argument("--timeout", type=float, default=PEER_TIMEOUT_S, help="peer wait, s")
        p.add_argument("--env-file", default="", help="write the found NCCL env here")
        p.add_argument("--json", action="store_true", help="print the report as JSON")
        p.set_defaults(func=_check_cmd)
    else:
        p = sub.add_parser(name, help="refuse a pair whose NCCL is not on the expected transport")
        p.add_argument("--host", required=True, help="the head's inventory name (in messages)")
        p.add_argument("--unit", default="", help="the serving unit whose journal to read")
        p.add_argument("--log", default="", help="read this file instead of the journal")
        p.add_argument("--expect", choices=TRANSPORTS, default="ib")
        p.add_argument("--on-mismatch", choices=("refuse", "warn"), default="refuse")
        p.set_defaults(func=_transport_cmd)
