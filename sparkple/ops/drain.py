"""The drain before a maintenance relaunch: wait until vLLM's /metrics shows no running or
waiting request, or the time runs out."""

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


def drain(metrics_url: str, timeout_s: float, log: Callable[[str], None]) -> bool:
    """Whether the engine drained (False without a metrics URL, when its metrics cannot be read,
    or when it is still busy at the deadline; each told through `log`)."""
    if not metrics_url:
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = requests_in_flight(metrics_url)
        if busy is None:
            log("drain: engine metrics unreadable; relaunching without draining")
            return False
        if busy == 0:
            return True
        time.sleep(min(5.0, max(0.1, deadline - time.monotonic())))
    log(f"drain: still busy after {timeout_s:g} s; relaunching anyway")
    return False
