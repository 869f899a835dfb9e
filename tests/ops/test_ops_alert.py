"""The alert webhook against real HTTP receivers: one that answers, one that never does."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest
from ops_helpers import above_real_memory, wait_for, watchdog_cmd

from sparkple.supervise.alert import Alerter


@pytest.fixture
def hung_url():
    """A port that accepts connections (the kernel's backlog) but never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/hook"
    sock.close()


def test_alerts_are_delivered_and_rate_limited_per_kind(tmp_path, receiver):
    url, got = receiver
    alerter = Alerter(tmp_path, url=url, min_interval_s=60)
    assert alerter.send("memory-emergency", "first", {"n": 1})
    assert not alerter.send("memory-emergency", "second, too soon")
    assert alerter.send("breaker-open", "another kind")
    alerter.drain(5)
    assert sorted(a["event"] for a in got) == ["breaker-open", "memory-emergency"]
    first = next(a for a in got if a["event"] == "memory-emergency")
    assert first["details"] == {"n": 1} and first["text"].endswith("first")
    # The limit holds across processes (the probe is a new process every run).
    again = Alerter(tmp_path, url=url, min_interval_s=60)
    assert not again.send("memory-emergency", "from another process")
    assert Alerter(tmp_path, url=url, min_interval_s=0).send("memory-emergency", "limit off")


def test_a_hung_receiver_never_blocks_the_sender(tmp_path, hung_url):
    # bounds relative to the send timeout (10 s), not tight absolute ones: a blocking send
    # or drain would take the whole 10 s, so a loaded machine cannot make this flake
    send_timeout_s = 10.0
    alerter = Alerter(tmp_path, url=hung_url, timeout_s=send_timeout_s)
    started = time.monotonic()
    assert alerter.send("engine-wedged", "x")
    sent = time.monotonic() - started
    assert sent < 0.2 * send_timeout_s, f"send took {sent:.2f} s: it must return at once"
    alerter.drain(0.3)
    drained = time.monotonic() - started - sent
    assert drained < 0.5 * send_timeout_s, f"drain waited {drained:.2f} s for the hung send"


def test_no_url_means_no_alerts(tmp_path, monkeypatch):
    monkeypatch.delenv("PLE_ALERT_URL", raising=False)
    assert not Alerter(tmp_path).send("memory-emergency", "x")
    assert not (tmp_path / "alerts.json").exists()


def watchdog(state, running: str, stop: str, *extra: object) -> list[str]:
    return watchdog_cmd(
        state,
        "--avail-floor-mib", above_real_memory(),
        "--running-cmd", running,
        "--logs-cmd", "true",
        "--stop-cmd", stop,
        *extra,
        interval_s=0.05,
    )  # fmt: skip


def test_the_watchdog_alerts_through_the_env_url(tmp_path, receiver):
    url, got = receiver
    target = subprocess.Popen(["sleep", "300"])
    argv = watchdog(tmp_path / "state", f"kill -0 {target.pid}", f"kill {target.pid}")
    wd = subprocess.Popen(argv, env={**os.environ, "PLE_ALERT_URL": url})
    try:
        wait_for(lambda: got, 10, "the alert")
    finally:
        wd.terminate()
        wd.wait(5)
        target.kill()
        target.wait()
    assert got[0]["event"] == "memory-emergency" and "stopped" in got[0]["message"]
    assert got[0]["details"]["stopped"] is True


def test_a_hung_receiver_costs_the_watchdog_nothing(tmp_path, hung_url):
    # Every trip alerts (no rate limit) into a receiver that never answers within the 3 s
    # send timeout; the trips still come at the sampling cadence, 5 x 0.05 s apart.
    state = tmp_path / "state"
    argv = watchdog(state, "true", "true", "--alert-min-interval-s", 0)
    started = time.monotonic()
    wd = subprocess.Popen(argv, env={**os.environ, "PLE_ALERT_URL": hung_url})
    try:
        wait_for(lambda: len(list((state / "markers").glob("*.json"))) >= 3, 10, "3 trips")
        took = time.monotonic() - started
    finally:
        wd.terminate()
        wd.wait(10)
    # a blocking send would hold each trip after the first for its 3 s timeout: 6 s or more
    assert took < 6.0, f"3 trips took {took:.2f} s; a blocking send would take 3 s per trip"
