"""The rollout's drain (playbooks/tasks/rollout_drain.yml) against a real HTTP /metrics.

One rule with or without a gateway: a host is drained when vLLM's running and waiting gauges
both read 0 (the package's sparkple.supervise.drain, which the supervisor's relaunch uses too). The
server here answers in vLLM's Prometheus format and moves its gauges after a given number of
reads, so the order of reads and of the playbook's end is what is asserted.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from ansible_local import ROOT, run_playbook

pytestmark = pytest.mark.slow  # one ansible-playbook run each

PLAYBOOK = f"""
- hosts: localhost
  gather_facts: false
  vars_files: [{ROOT}/playbooks/vars/rollout.yml]
  tasks:
    - ansible.builtin.include_tasks: {ROOT}/playbooks/tasks/rollout_drain.yml
"""


class Gauges:
    """(running, waiting) for each read of /metrics in turn; the last pair stays."""

    def __init__(self, *readings: tuple[int, int]) -> None:
        self.readings = list(readings)
        self.reads = 0

    def next(self) -> tuple[int, int]:
        pair = self.readings[min(self.reads, len(self.readings) - 1)]
        self.reads += 1
        return pair


@pytest.fixture
def metrics() -> Iterator[tuple[Gauges, str]]:
    gauges = Gauges((0, 0))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - stdlib name
            running, waiting = gauges.next()
            labels = '{engine="0",model_name="qwen3.8-flash-next"}'
            body = (
                "# TYPE vllm:num_requests_running gauge\n"
                f"vllm:num_requests_running{labels} {float(running)}\n"
                "# TYPE vllm:num_requests_waiting gauge\n"
                f"vllm:num_requests_waiting{labels} {float(waiting)}\n"
            ).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield gauges, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def drain(tmp_path: Path, url: str, timeout_s: int = 30):
    return run_playbook(
        tmp_path,
        PLAYBOOK,
        {
            "sparkple_api_url": url,
            "release_current_id": "0123456789abcdef",
            "sparkple_gateway_host": "",
            "sparkple_rollout_drain_timeout_s": timeout_s,
            "sparkple_rollout_drain_poll_s": 1,
            # the host's Python with the checkout's package (sparkple.supervise.drain)
            "sparkple_host_python": sys.executable,
        },
    )


def test_waiting_requests_keep_the_host_draining(tmp_path: Path, metrics) -> None:
    gauges, url = metrics
    # nothing runs but two wait (the scheduler has not picked them up yet), then one runs
    gauges.readings = [(0, 2), (0, 2), (1, 0), (0, 0)]
    proc = drain(tmp_path, url)
    assert proc.returncode == 0, proc.stdout[-3000:]
    # it read until both gauges were 0, not at the first "0 running"
    assert gauges.reads == 4, (gauges.reads, proc.stdout[-2000:])


def test_a_host_that_stays_busy_fails_the_drain_in_time(tmp_path: Path, metrics) -> None:
    gauges, url = metrics
    gauges.readings = [(0, 1)]
    proc = drain(tmp_path, url, timeout_s=3)
    assert proc.returncode != 0
    assert "Wait until the engine has no running and no waiting request" in proc.stdout
    assert 3 <= gauges.reads <= 5, gauges.reads


def test_no_server_answering_has_nothing_to_drain(tmp_path: Path, metrics) -> None:
    _, url = metrics
    proc = drain(tmp_path, "http://127.0.0.1:9", timeout_s=30)  # discard port: refused
    assert proc.returncode == 0, proc.stdout[-3000:]
    # the first read found nothing to wait for: the wait did not retry (Ansible prints a line
    # for each retry of an `until` loop)
    assert "Wait until the engine has no running and no waiting request" in proc.stdout
    assert "FAILED - RETRYING" not in proc.stdout, proc.stdout[-2000:]
