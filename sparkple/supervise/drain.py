"""The drain rule, one home for the supervisor's maintenance relaunch and the rollout: wait until
vLLM's /metrics shows no running or waiting request, or the time runs out."""

from __future__ import annotations

import argparse
import time
import urllib.request
from collections.abc import Callable


def drain_options() -> argparse.ArgumentParser:
    """The drain's flags (an argparse parent)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--drain-metrics-url", default="", help="vLLM /metrics; empty: no drain")
    p.add_argument("--drain-timeout-s", type=float, default=600.0)
    return p


def requests_in_flight(url: str) -> float | None:
    """Sum of vLLM's running and waiting request gauges from its Prometheus endpoint."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode("utf-8", "replace")
    except OSError:
        return None
    total, seen = 0.0, False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            try:
                total += float(line.rsplit(" ", 1)[1])
                seen = True
            except (IndexError, ValueError):
                continue
    return total if seen else None


def wait_until_idle(metrics_url: str, timeout_s: float, poll_s: float = 5.0) -> float | None:
    """The requests in flight when the wait ends: 0 once the engine drained; None when its
    metrics cannot be read (no engine answering); more than 0 when still busy at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = requests_in_flight(metrics_url)
        left = deadline - time.monotonic()
        if not busy or left <= 0:  # None or 0: nothing to wait for
            return busy
        time.sleep(min(poll_s, max(0.1, left)))


def drain(metrics_url: str, timeout_s: float, log: Callable[[str], None]) -> bool:
    """Whether the engine drained (False without a metrics URL, when its metrics cannot be read,
    or when it is still busy at the deadline; each told through `log`)."""
    if not metrics_url:
        return False
    busy = wait_until_idle(metrics_url, timeout_s)
    if busy is None:
        log("drain: engine metrics unreadable; relaunching without draining")
    elif busy:
        log(f"drain: still busy after {timeout_s:g} s; relaunching anyway")
    return busy == 0


def drain_command(metrics_url: str, timeout_s: float, poll_s: float) -> int:
    """`supervisor drain`, the rollout's wait before it stops a host's server: exit 0 once
    nothing is in flight (drained, or no engine answering: nothing to wait for), 1 when the
    engine is still busy at the deadline."""
    busy = wait_until_idle(metrics_url, timeout_s, poll_s)
    if busy is None:
        print(f"drain: no engine answers at {metrics_url}: nothing in flight to wait for")
    elif busy:
        print(f"drain: {busy:g} requests still running or waiting after {timeout_s:g} s")
        return 1
    else:
        print("drain: no request running or waiting")
    return 0
