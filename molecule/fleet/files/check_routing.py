#!/usr/bin/env python3
"""Read HAProxy's journal in order and check that no request went to a server that was out.

A server is out from "is DOWN" / "enters maintenance" / "is going DOWN for maintenance" until
"is UP". A drained server still finishes its running requests (HAProxy logs a request when it
ends), so draining alone does not count as out. Every request must be a 200 from a Spark, with
no error termination and no retry. Prints a JSON summary; exit status 1 on any violation.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

OUT = re.compile(r"^Server (\S+)/(\S+) (is DOWN|.*enters maintenance|is going DOWN for maint)")
UP = re.compile(r"^Server (\S+)/(\S+) is UP")
REQUEST = re.compile(r"^sparkple-gateway (\S+) (\S+)/(\S+) (-?\d+) (\S+) (\d+) ")


def main() -> int:
    lines = subprocess.run(
        ["journalctl", "-u", "haproxy", "-o", "cat", "--no-pager"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    out: set[str] = set()
    transitions = 0
    per_server: dict[str, int] = {}
    violations: list[str] = []
    for line in lines:
        if m := OUT.match(line):
            out.add(m.group(2))
            transitions += 1
        elif m := UP.match(line):
            out.discard(m.group(2))
            transitions += 1
        elif m := REQUEST.match(line):
            server, status, term, retries = m.group(3), m.group(4), m.group(5), m.group(6)
            per_server[server] = per_server.get(server, 0) + 1
            if server in out:
                violations.append(f"routed to {server} while it was out: {line}")
            if status != "200" or term != "--" or retries != "0":
                violations.append(f"not a clean 200: {line}")
    summary = {
        "requests": sum(per_server.values()),
        "per_server": per_server,
        "state_changes": transitions,
        "violations": violations[:20],
    }
    print(json.dumps(summary))
    return 1 if violations or not per_server else 0


if __name__ == "__main__":
    sys.exit(main())
