"""A bounded client for the fleet scenario: completions through the gateway, one at a time.

Stops at --max-requests, at --max-seconds, or when --stop-file appears, whichever comes first,
and writes what it saw to --out as JSON: ok/failed counts, the failures, requests per server.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.request


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--max-requests", type=int, required=True)
    p.add_argument("--max-seconds", type=float, required=True)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--pause", type=float, default=0.05)
    args = p.parse_args()
    body = json.dumps(
        {"model": "Qwen/Qwen3.8-Flash-Next", "prompt": "hello fleet", "max_tokens": 4}
    ).encode()
    ok, failures, per_server = 0, [], {}
    start = time.monotonic()
    sent = 0
    while sent < args.max_requests and time.monotonic() - start < args.max_seconds:
        if os.path.exists(args.stop_file):
            break
        sent += 1
        req = urllib.request.Request(
            args.url, data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                answer = json.loads(resp.read())
                server = resp.headers.get("X-Sparkple-Server", "?")
            if answer["usage"]["completion_tokens"] != 4:
                raise ValueError(f"{answer['usage']['completion_tokens']} tokens instead of 4")
            ok += 1
            per_server[server] = per_server.get(server, 0) + 1
        except (OSError, ValueError, KeyError, urllib.error.HTTPError) as exc:
            failures.append(f"{time.monotonic() - start:.2f}s {type(exc).__name__}: {exc}")
        time.sleep(args.pause)
    result = {
        "sent": sent,
        "ok": ok,
        "failed": len(failures),
        "failures": failures[:20],
        "per_server": per_server,
        "seconds": round(time.monotonic() - start, 1),
    }
    with open(args.out + ".tmp", "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(args.out + ".tmp", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
