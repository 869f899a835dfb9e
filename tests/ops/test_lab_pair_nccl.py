"""The lab pair's model of NCCL's init lines (lab/lab_pair.py, announce_network): two real lab
servers formed as a pair print the lines NCCL would for the transport their environment selects,
and the head's transport check (`sparkple pair-transport`) reads them from the head's output as
it reads the unit's journal on a Spark. Forced to IB without an RDMA device, a node fails its
start as NCCL does."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from ops_helpers import ROOT, wait_for
from test_lab_server import health
from test_lab_server_pair import HEAD, WORKER, Node, start_node  # noqa: F401 - the fixture

NCCL = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_SOCKET_IFNAME": "lo"}


def transport(log: Path, expect: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sparkple.cli", "pair-transport", f"--host={HEAD}",
         f"--log={log}", f"--expect={expect}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_socket_pair_logs_its_network_and_the_head_check_reads_it(
    start_node: Callable[..., Node],  # noqa: F811 - the imported fixture
) -> None:
    env = {**NCCL, "NCCL_NET": "Socket", "NCCL_IB_DISABLE": "1"}
    head = start_node(HEAD, env=env)
    wait_for(lambda: health(head.port) is not None, 30, "the head listening")
    worker = start_node(WORKER, env=env)
    wait_for(lambda: health(head.port) == 200, 30, "the head healthy with its worker")
    wait_for(lambda: "Using network Socket" in worker.output(), 10, "the worker's NCCL lines")
    assert "NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0>" in head.output()
    assert transport(head.log, "socket").returncode == 0
    refused = transport(head.log, "ib")
    assert refused.returncode == 1 and "NCCL uses Socket, not ib" in refused.stderr


def test_a_node_forced_to_ib_without_a_device_fails_its_start(
    start_node: Callable[..., Node],  # noqa: F811 - the imported fixture
) -> None:
    head = start_node(HEAD, env={**NCCL, "NCCL_NET": "IB"})
    wait_for(lambda: health(head.port) is not None, 30, "the head listening")
    worker = start_node(WORKER, env={**NCCL, "NCCL_NET": "IB"})
    assert worker.proc.wait(timeout=30) != 0
    assert "NET/IB : No device found." in worker.output()
    assert "Failed to initialize any NET plugin" in worker.output()
