"""A bounded load for the fleet scenario: concurrent streaming completions through the gateway.

--clients threads each send one streaming completion after the other (`"stream": true`, as a
chat client does; the lab server takes SPARKPLE_LAB_TOKEN_DELAY_S per token, so each lasts
seconds; the clients ask for four different lengths, so that a server's streams end apart).
Meanwhile one thread reads the gateway's server states from HAProxy's admin socket
(`--gateway-socket`, `show stat`, the command `sparkple-gateway show` reads) every --poll-s
(20 times a second by default, so that a drain is seen within 50 ms: a request that ended
between the drain and a later poll would not count as in flight across it).

Stops at --max-requests, at --max-seconds, or when --stop-file appears, whichever comes first,
and records which. Writes to --out as JSON: requests sent, ok, failed (with the first
failures), truncated streams (no final chunk with a finish_reason, or no `data: [DONE]`), the
most requests seen in flight at once, requests per server, and per drained server the
requests in flight across its drain: served by it, started before the gateway showed it
draining and ended after.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from typing import Any


class Load:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.lock = threading.Lock()
        self.sent = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self.done: list[dict[str, Any]] = []
        self.stop_reason = ""
        self.start = time.time()
        # each change of a server's status the gateway showed, with the polls around it
        self.changes: list[dict[str, Any]] = []
        # an https URL is verified against --ca-file (the gateway's CA)
        self.tls = ssl.create_default_context(cafile=args.ca_file) if args.ca_file else None

    def should_stop(self) -> bool:
        """Decide (once) whether to stop, and why; every thread asks before a new request."""
        with self.lock:
            if not self.stop_reason:
                if os.path.exists(self.args.stop_file):
                    self.stop_reason = "stop-file"
                elif self.sent >= self.args.max_requests:
                    self.stop_reason = "max-requests"
                elif time.time() - self.start >= self.args.max_seconds:
                    self.stop_reason = "max-seconds"
            return bool(self.stop_reason)

    def client(self, tokens: int) -> None:
        request = {"model": self.args.model, "prompt": "hello fleet", "max_tokens": tokens}
        body = json.dumps({**request, "stream": True}).encode()
        while not self.should_stop():
            with self.lock:
                self.sent += 1
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
            record = self.one(body, tokens)
            with self.lock:
                self.in_flight -= 1
                self.done.append(record)
                if len(self.done) == self.args.clients:
                    # as many streams done as clients: the load is steady, the rollout may start
                    with open(self.args.ready_file, "w", encoding="utf-8") as f:
                        f.write(f"{time.time()}\n")

    def one(self, body: bytes, tokens: int) -> dict[str, Any]:
        """One streaming request: when it started and ended, where it went, how it ended."""
        record: dict[str, Any] = {"start": time.time(), "server": "?", "chunks": 0}
        req = urllib.request.Request(
            self.args.url, data=body, headers={"Content-Type": "application/json"}
        )
        finish, done_seen = None, False
        try:
            with urllib.request.urlopen(req, timeout=60, context=self.tls) as resp:
                record["server"] = resp.headers.get("X-Sparkple-Server", "?")
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        done_seen = True
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise ValueError(f"error chunk: {chunk['error']}")
                    record["chunks"] += 1
                    finish = chunk["choices"][0]["finish_reason"] or finish
            if record["chunks"] != tokens or finish != "length" or not done_seen:
                record["truncated"] = True
                raise ValueError(
                    f"truncated stream: {record['chunks']} of {tokens} chunks, "
                    f"finish_reason {finish}, [DONE] {'seen' if done_seen else 'missing'}"
                )
            record["ok"] = True
        except (OSError, ValueError, KeyError, IndexError, urllib.error.HTTPError) as exc:
            record["ok"] = False
            record["error"] = f"{type(exc).__name__}: {exc}"
        record["end"] = time.time()
        return record

    def server_states(self) -> dict[str, str]:
        """Each server of the backend and its status, from HAProxy's `show stat`."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(self.args.gateway_socket)
            s.sendall(b"show stat\n")
            text = b"".join(iter(lambda: s.recv(65536), b"")).decode()
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {
            r["svname"]: r["status"]
            for r in rows
            if r.get("pxname") == self.args.gateway_backend
            and r.get("svname") not in ("FRONTEND", "BACKEND")
        }

    def watch_gateway(self) -> None:
        last: dict[str, tuple[float, str]] = {}  # per server: the last poll's time and status
        while not self.stop_reason or self.in_flight:
            now = time.time()
            try:
                states = self.server_states()
            except (OSError, ValueError, KeyError):
                states = {}
            with self.lock:
                for server, status in states.items():
                    before = last.get(server)
                    if before is not None and before[1] != status:
                        # the change happened between the two polls
                        self.changes.append(
                            {
                                "server": server,
                                "from": before[1],
                                "to": status,
                                "last_before": before[0],
                                "seen_at": now,
                            }  # fmt: skip
                        )
                    last[server] = (now, status)
            time.sleep(self.args.poll_s)

    def drains(self) -> dict[str, list[dict[str, Any]]]:
        """Per server, each change from UP and the requests in flight across it: served by it,
        started before the gateway showed the change and ended after. HAProxy sends a draining
        server no new connection (its management guide, `set server ... state drain`; nothing
        here is sticky), so a request it routed there was routed before the drain: one that
        started between the last poll that showed UP and the drain counts too."""
        out: dict[str, list[dict[str, Any]]] = {}
        for change in self.changes:
            if change["from"] != "UP":
                continue
            served = [r for r in self.done if r["server"] == change["server"]]
            across = [r for r in served if r["ok"] and r["start"] < change["seen_at"] < r["end"]]
            # when the server's last stream before the change ended: tells a drain that found
            # nothing in flight because traffic had already stopped from one that was unlucky
            ended = [r["end"] for r in served if r["end"] <= change["seen_at"]]
            # the server's requests (start, end, ok) around the change, so that a drain that
            # caught none can be read from the result alone
            around = [
                [round(r["start"], 2), round(r["end"], 2), r["ok"]]
                for r in served
                if r["end"] > change["last_before"] - 10 and r["start"] < change["seen_at"] + 10
            ]
            out.setdefault(change["server"], []).append(
                {
                    **change,
                    "in_flight": len(across),
                    "last_end_before": max(ended, default=None),
                    "around": sorted(around),
                }
            )
        return out

    def result(self) -> dict[str, Any]:
        failures = [r for r in self.done if not r["ok"]]
        per_server: dict[str, int] = {}
        for r in self.done:
            if r["ok"]:
                per_server[r["server"]] = per_server.get(r["server"], 0) + 1
        drains = self.drains()
        return {
            "sent": self.sent,
            "ok": len(self.done) - len(failures),
            "failed": len(failures),
            "truncated": sum(1 for r in self.done if r.get("truncated")),
            "failures": [
                f"{r['start'] - self.start:.2f}s {r['server']}: {r['error']}" for r in failures
            ][:20],
            "clients": self.args.clients,
            "concurrent": self.most_in_flight,
            "per_server": per_server,
            "drains": drains,
            "in_flight_across_drains": {
                s: sum(d["in_flight"] for d in ds) for s, ds in drains.items()
            },
            "stop_reason": self.stop_reason,
            "stopped_at": time.time(),
            "seconds": round(time.time() - self.start, 1),
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--ca-file", help="CA certificates to verify an https URL with")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    p.add_argument("--max-tokens", type=int, default=24, help="the shortest client's tokens")
    p.add_argument("--max-requests", type=int, required=True)
    p.add_argument("--max-seconds", type=float, required=True)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--ready-file", required=True, help="written once the load is steady")
    p.add_argument("--gateway-socket", required=True, help="HAProxy's admin socket")
    p.add_argument("--gateway-backend", required=True, help="the backend of the Sparks")
    p.add_argument("--poll-s", type=float, default=0.05)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    load = Load(args)
    watcher = threading.Thread(target=load.watch_gateway, daemon=True)
    watcher.start()
    # Client i asks for max-tokens + 8 * (i mod 4) tokens. With streams of one length, leastconn
    # kept each server's streams in step (each ends as the next starts on the same server), and
    # a drain that fell between their ends found none in flight.
    clients = [
        threading.Thread(target=load.client, args=(args.max_tokens + 8 * (i % 4),))
        for i in range(args.clients)
    ]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    watcher.join(10)
    with open(args.out + ".tmp", "w", encoding="utf-8") as f:
        json.dump(load.result(), f)
    os.replace(args.out + ".tmp", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
