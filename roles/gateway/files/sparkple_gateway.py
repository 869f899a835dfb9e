#!/usr/bin/env python3
"""sparkple-gateway: drain, ready and show the Sparks behind HAProxy, through its admin socket.

  sparkple-gateway show                      one JSON object per server of the backend
  sparkple-gateway drain HOST                no new requests for HOST (those it runs go on)
  sparkple-gateway maint HOST                maintenance: HAProxy stops checking it too
  sparkple-gateway ready HOST [--timeout S]  back into the pool, wait until the checks say UP

A host is drained when its engine has no running and no waiting request (vLLM's
num_requests_running + num_requests_waiting): the rollout waits for that on the host's own
/metrics between `drain` and `maint`, with or without a gateway, rather than on HAProxy's
connection counts, which do not see the engine's queue.

Exit status: 0 done, 1 the server did not reach the state in time, 2 bad usage or no such server.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import socket
import sys
import time
from collections.abc import Callable

ERR = sys.stderr
# Seconds HAProxy gets to show an admin state it was told to take (it takes it at once).
STATE_CHANGE_S = 10.0


def command(sock_path: str, line: str) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(sock_path)
        s.sendall(line.encode() + b"\n")
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def servers(sock_path: str, backend: str) -> dict[str, dict[str, str]]:
    text = command(sock_path, "show stat").lstrip("# ")
    rows = csv.DictReader(io.StringIO(text))
    return {
        r["svname"]: r
        for r in rows
        if r.get("pxname") == backend and r.get("svname") not in ("FRONTEND", "BACKEND")
    }


def summary(row: dict[str, str]) -> dict[str, object]:
    counters = (
        "scur",
        "qcur",
        "stot",
        "econ",
        "eresp",
        "wretr",
        "wredis",
        "chkdown",
        "hrsp_2xx",
        "hrsp_5xx",
    )
    out: dict[str, object] = {"server": row["svname"], "status": row["status"]}
    out.update({k: int(row.get(k) or 0) for k in counters})
    return out


def wait_for(
    sock_path: str,
    backend: str,
    host: str,
    done: Callable[[dict[str, object]], bool],
    timeout: float,
) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        row = summary(servers(sock_path, backend)[host])
        if done(row):
            return row
        if time.monotonic() > deadline:
            raise TimeoutError(row)
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", default="/run/haproxy/admin.sock")
    p.add_argument("--backend", default="sparks")
    p.add_argument("action", choices=["show", "drain", "maint", "ready"])
    p.add_argument("host", nargs="?")
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    try:
        table = servers(args.socket, args.backend)
    except OSError as exc:
        print(
            f"sparkple-gateway: cannot read {args.socket}: {exc}; is haproxy running?",
            file=ERR,
        )
        return 2
    if args.action == "show":
        print(json.dumps([summary(r) for r in table.values()]))
        return 0
    if args.host not in table:
        print(
            f"sparkple-gateway: {args.host!r} is not a server of {args.backend} ({sorted(table)})",
            file=ERR,
        )
        return 2
    target = f"{args.backend}/{args.host}"
    limit = args.timeout if args.action == "ready" else STATE_CHANGE_S
    try:
        if args.action == "drain":
            # DRAIN once taken; a server that is down (not started yet) stays DOWN: no new
            # requests go to either
            command(args.socket, f"set server {target} state drain")
            row = wait_for(
                args.socket,
                args.backend,
                args.host,
                lambda r: not str(r["status"]).startswith("UP"),
                limit,
            )
        elif args.action == "maint":
            command(args.socket, f"set server {target} state maint")
            row = wait_for(
                args.socket,
                args.backend,
                args.host,
                lambda r: str(r["status"]).startswith("MAINT"),
                limit,
            )
        else:
            command(args.socket, f"set server {target} state ready")
            row = wait_for(
                args.socket, args.backend, args.host, lambda r: r["status"] == "UP", limit
            )
    except TimeoutError as exc:
        print(
            f"sparkple-gateway: {target} did not {args.action} within {limit:.0f} s: {exc}",
            file=ERR,
        )
        return 1
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
