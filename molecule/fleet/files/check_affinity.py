#!/usr/bin/env python3
"""Conversation affinity at the gateway, checked on the gateway host over HTTPS.

--sessions conversations of --turns turns each (short completions; the conversations side by
side, each one's turns one after the other), every request with the session header: all of a
conversation's turns must be served by one Spark (the X-Sparkple-Server header), and the
conversations must spread over more than one Spark. Then the Spark holding the most
conversations is drained (`sparkple-gateway drain`) and each conversation takes one more turn:
the drained Spark's conversations move, every other one stays where it was. The Spark is
readied again (`sparkple-gateway ready`) and its conversations come back to it.

Prints a JSON summary; exit status 1 on any violation.
"""

from __future__ import annotations

import argparse
import json
import ssl
import subprocess
import sys
import threading
import urllib.request
from collections import Counter


def turn(args: argparse.Namespace, tls: ssl.SSLContext, session: str) -> str:
    """One short completion in the conversation `session`: the Spark that served it."""
    body = json.dumps({"model": args.model, "prompt": "turn", "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json", args.header: session}
    req = urllib.request.Request(args.url, data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=60, context=tls) as resp:
        resp.read()
        return str(resp.headers.get("X-Sparkple-Server", "?"))


def conversations(
    args: argparse.Namespace, tls: ssl.SSLContext, sessions: list[str], turns: int
) -> dict[str, list[str]]:
    """Each session's servers, turn by turn; the sessions run side by side."""
    served: dict[str, list[str]] = {s: [] for s in sessions}

    def talk(session: str) -> None:
        for _ in range(turns):
            served[session].append(turn(args, tls, session))

    threads = [threading.Thread(target=talk, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return served


def gateway(*argv: str) -> None:
    subprocess.run(["sparkple-gateway", *argv], check=True, capture_output=True, timeout=60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the gateway's completions URL (https)")
    p.add_argument("--ca-file", required=True, help="the gateway's CA certificate")
    p.add_argument("--model", required=True)
    p.add_argument("--header", default="X-Session-Id")
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=20)
    args = p.parse_args()
    tls = ssl.create_default_context(cafile=args.ca_file)
    sessions = [f"conversation-{i}" for i in range(args.sessions)]
    violations: list[str] = []

    served = conversations(args, tls, sessions, args.turns)
    home = {s: servers[0] for s, servers in served.items()}
    for s, servers in served.items():
        if len(set(servers)) != 1:
            violations.append(f"{s} moved between Sparks: {servers}")
    spread = Counter(home.values())
    if len(spread) < 2:
        violations.append(f"every conversation went to one Spark: {dict(spread)}")

    drained = spread.most_common(1)[0][0]
    gateway("drain", drained)
    try:
        during = {s: servers[0] for s, servers in conversations(args, tls, sessions, 1).items()}
    finally:
        gateway("ready", drained)
    moved = sorted(s for s in sessions if during[s] != home[s])
    expected = sorted(s for s in sessions if home[s] == drained)
    if moved != expected:
        violations.append(f"drained {drained}: moved {moved}, expected its own {expected}")
    if drained in during.values():
        violations.append(f"{drained} was sent a conversation while draining")
    after = {s: servers[0] for s, servers in conversations(args, tls, sessions, 1).items()}
    if after != home:
        violations.append(f"after {drained} came back: {after}, before the drain {home}")

    print(
        json.dumps(
            {
                "sessions": args.sessions,
                "turns": args.turns,
                "per_server": dict(spread),
                "drained": drained,
                "moved": len(moved),
                "violations": violations[:20],
            }
        )
    )
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
