"""A lab pair: lab/lab_server.py as the head (--node-rank 0) and its headless worker
(--node-rank 1) of `vllm serve --tensor-parallel-size 2 --nnodes 2`, two real processes with a
real TCP link on the loopback, each on a real table, with the multi-node words the pair's units
get (sparkple.pair.plan). What each side does when the other dies is vLLM 0.33.0's
multiproc executor's (docs/tensor-parallel.md): a head is healthy only while its worker is
connected and its server exits after the step timeout once it is gone; a worker outlives its
head and must be restarted."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from lab_inputs import free_port
from ops_helpers import LAB, ROOT, alive, children, wait_for
from test_lab_server import complete, health, request
from test_lab_server_api import refused

from sparkple.builder.build import build_table
from sparkple.builder.synth import synth_checkpoint
from sparkple.pair.plan import Pair, PairNode

HEAD, WORKER = "spark-a", "spark-b"
# The lab's stand-in for VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s on a Spark).
PEER_TIMEOUT_S = 1.5
# How soon the head must see its worker gone: a heartbeat missing for 3 s, and the polls.
DETECT_S = 4.5
# how long a node told to stop may take to exit cleanly: a bound for a loaded machine (CI runs
# this beside the fleet scenario), not a speed the test asserts
EXIT_S = 60


def pair_at(master_port: int) -> Pair:
    """The pair of the inventory: the head's link address is the rendezvous address."""
    return Pair(
        name="lab",
        head=PairNode(HEAD, 0, "127.0.0.1", "lo", "rocep1s0f1", 3),
        worker=PairNode(WORKER, 1, "127.0.0.2", "lo", "rocep1s0f1", 3),
        master_port=master_port,
    )


class Node:
    """One node's server process: its output in `log`, its HTTP port (unused on a worker) and
    the pair's rendezvous port."""

    def __init__(self, proc: subprocess.Popen, log: Path, port: int, master_port: int) -> None:
        self.proc, self.log, self.port, self.master_port = proc, log, port, master_port

    def output(self) -> str:
        return self.log.read_text()

    def kill(self) -> None:
        """SIGKILL to every process of the node (a container killed, a host gone)."""
        for pid in [*children(self.proc.pid), self.proc.pid]:
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Another revision of lab_data's checkpoint (the same geometry, another snapshot id and
    other weights) and its table: what a node that loaded a different revision serves."""
    root = tmp_path_factory.mktemp("lab-pair-other")
    snap = synth_checkpoint(root / "other-revision", vocab_base=4_000, files=1, seed=6)
    build_table(snap, root / "table", quiet=True)
    return {"snap": snap, "table": root / "table"}


@pytest.fixture
def start_node(lab_data: dict, tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """start_node(host, model=None, env=None): that host's server of one pair (one master port
    per test). Every process is killed at teardown."""
    pair = pair_at(free_port())
    started: list[Node] = []

    def start(host: str, model: dict | None = None, env: dict | None = None) -> Node:
        files = model or lab_data
        port = free_port()
        full_env = {**os.environ,
                    "PYTHONPATH": f"{ROOT}{os.pathsep}{lab_data['site']}",
                    "SPARKPLE_PLE_TABLE_DIR": str(files["table"]),
                    "SPARKPLE_PATCH_DIR": str(lab_data["patches"]),
                    "SPARKPLE_LAB_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S),
                    "SPARKPLE_LAB_JOIN_TIMEOUT_S": "30",
                    **(env or {})}  # fmt: skip
        argv = [sys.executable, str(LAB / "lab_server.py"), "--model", str(files["snap"]),
                "--port", str(port), "--distributed-executor-backend=mp",
                *pair.vllm_args(host)]  # fmt: skip
        log = tmp_path / f"{host}-{len(started)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, env=full_env, stdout=out, stderr=subprocess.STDOUT)
        node = Node(proc, log, port, pair.master_port)
        started.append(node)
        return node

    yield start
    for node in started:
        for pid in [*children(node.proc.pid), node.proc.pid]:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.proc.wait()


def healthy_pair(start_node: Callable[..., Node]) -> tuple[Node, Node]:
    head = start_node(HEAD)
    wait_for(lambda: health(head.port) is not None, 30, "the head listening")
    worker = start_node(WORKER)
    wait_for(lambda: health(head.port) == 200, 30, "the head healthy with its worker")
    return head, worker


def test_head_is_healthy_only_once_its_worker_joined(start_node) -> None:
    head = start_node(HEAD)
    wait_for(lambda: health(head.port) is not None, 30, "the head listening")
    rendezvous = f"127.0.0.1:{head.master_port}"  # the head's own link address
    for _ in range(5):  # its table open, it waits for node 1 and says so
        code, body = request(head.port, "/health")
        assert code == 503, body
        time.sleep(0.2)
    assert body["error"] == f"waiting for node 1 of the pair at {rendezvous}"
    assert complete(head.port)[0] == 503
    with urllib.request.urlopen(f"http://127.0.0.1:{head.port}/metrics", timeout=5) as r:
        assert r.status == 200 and b"vllm:num_requests_running" in r.read()  # as on one Spark
    worker = start_node(WORKER)
    wait_for(lambda: health(head.port) == 200, 30, "the head healthy with its worker")
    code, reply = complete(head.port, 8)
    assert code == 200 and reply["usage"]["completion_tokens"] == 8, reply
    # the worker is headless: one process, no API server on the port its argv names
    assert children(worker.proc.pid) == []
    assert health(worker.port) is None
    # SIGTERM stops each side cleanly
    head.proc.send_signal(signal.SIGTERM)
    worker.proc.send_signal(signal.SIGTERM)
    assert head.proc.wait(EXIT_S) == 0
    assert worker.proc.wait(EXIT_S) == 0


def test_a_killed_worker_kills_the_heads_engine(start_node) -> None:
    head, worker = healthy_pair(start_node)
    lost_at = time.monotonic()
    worker.kill()
    wait_for(lambda: health(head.port) == 503, DETECT_S, "the head's /health 503")
    code, body = request(head.port, "/health")
    assert "node 1 (worker)" in body["error"] and "is gone" in body["error"], body
    assert complete(head.port)[0] == 503
    # the server exits 1 once its engine died, the step timeout after the worker went
    assert head.proc.wait(PEER_TIMEOUT_S + 10) == 1
    assert time.monotonic() - lost_at >= PEER_TIMEOUT_S
    assert "the engine exited with code 1" in head.output()


def test_a_stopped_worker_is_noticed_by_its_missing_heartbeat(start_node) -> None:
    head, worker = healthy_pair(start_node)
    os.kill(worker.proc.pid, signal.SIGSTOP)  # the connection stays open
    try:
        wait_for(lambda: health(head.port) == 503, DETECT_S, "the head's /health 503")
        assert "sent no heartbeat" in request(head.port, "/health")[1]["error"]
        assert head.proc.wait(PEER_TIMEOUT_S + 10) == 1
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)
    # continued, the worker finds its head gone and, as vLLM's, stays up until it is stopped
    wait_for(lambda: "is gone" in worker.output(), 10, "the worker seeing its head gone")
    assert worker.proc.poll() is None
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(EXIT_S) == 0


def test_a_worker_outlives_its_head_and_never_joins_another(start_node) -> None:
    head, worker = healthy_pair(start_node)
    head.kill()
    wait_for(lambda: "is gone" in worker.output(), DETECT_S, "the worker seeing its head gone")
    time.sleep(2)
    assert worker.proc.poll() is None and alive(worker.proc.pid)
    # a new head at the same rendezvous waits for a worker that does not come back
    second = start_node(HEAD)
    wait_for(lambda: health(second.port) is not None, 30, "the new head listening")
    time.sleep(1.5)
    code, body = request(second.port, "/health")
    assert code == 503 and body["error"].startswith("waiting for node 1"), body
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(EXIT_S) == 0
    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(EXIT_S) == 0


def test_a_second_worker_is_refused(start_node) -> None:
    head, worker = healthy_pair(start_node)
    intruder = start_node(WORKER)
    assert intruder.proc.wait(30) == 1
    assert "refused this node: its node 1 is node 1 (worker)" in intruder.output()
    assert health(head.port) == 200 and worker.proc.poll() is None


def test_nodes_with_different_tables_both_refuse_naming_both(
    start_node, lab_data, other_model
) -> None:
    head = start_node(HEAD)
    worker = start_node(WORKER, model=other_model)
    assert worker.proc.wait(30) == 1
    assert head.proc.wait(30) == 1
    for node in (head, worker):
        out = node.output()
        assert "the pair's nodes serve different PLE tables" in out, out
        assert "node 0 (head) on " in out and f"table {lab_data['table']}," in out
        assert "node 1 (worker) on " in out and f"table {other_model['table']}," in out
        differ = out.split("differ in ", 1)[1].split(".", 1)[0]
        assert differ == "global_scale, source", out


RELEASE = {"SPARKPLE_RELEASE_ID": "1f0c2a9be47d3e55", "SPARKPLE_PATCH_MANIFEST_SHA256": "a" * 64}


@pytest.mark.parametrize(
    ("worker_env", "differ", "worker_runs"),
    [
        ({**RELEASE, "SPARKPLE_RELEASE_ID": "7b3e90d1c2f4a685"}, "release id",
         "release 7b3e90d1c2f4a685, patch manifest sha256 " + "a" * 64),
        ({**RELEASE, "SPARKPLE_PATCH_MANIFEST_SHA256": "b" * 64}, "patch manifest",
         "release 1f0c2a9be47d3e55, patch manifest sha256 " + "b" * 64),
        ({"SPARKPLE_RELEASE_ID": "", "SPARKPLE_PATCH_MANIFEST_SHA256": ""},
         "release id and patch manifest", "release (not set), patch manifest sha256 (not set)"),
    ],
    ids=["release-id", "manifest", "unset"],
)  # fmt: skip
def test_nodes_of_different_releases_both_refuse_naming_both(
    start_node, worker_env: dict, differ: str, worker_runs: str
) -> None:
    """One table, one model: the nodes differ only in the release their units name, as a pair
    with one node rolled back and the other not."""
    head = start_node(HEAD, env=RELEASE)
    worker = start_node(WORKER, env=worker_env)
    assert worker.proc.wait(30) == 1
    assert head.proc.wait(30) == 1
    host = socket.gethostname()
    for node in (head, worker):
        out = node.output()
        assert (
            "the pair's nodes run different releases: node 0 (head) on "
            f"{host} runs release 1f0c2a9be47d3e55, patch manifest sha256 {'a' * 64} and "
            f"node 1 (worker) on {host} runs {worker_runs} (they differ in {differ})"
        ) in out, out


def test_nodes_of_one_release_pair(start_node) -> None:
    head = start_node(HEAD, env=RELEASE)
    wait_for(lambda: health(head.port) is not None, 30, "the head listening")
    worker = start_node(WORKER, env=RELEASE)
    wait_for(lambda: health(head.port) == 200, 30, "the head healthy with its worker")
    assert complete(head.port, 4)[0] == 200
    assert worker.proc.poll() is None


def test_either_side_waiting_for_the_other_stops_cleanly(start_node) -> None:
    head = start_node(HEAD)
    wait_for(lambda: "waiting for node 1" in head.output(), 30, "the head waiting")
    head.proc.send_signal(signal.SIGTERM)
    assert head.proc.wait(EXIT_S) == 0
    worker = start_node(WORKER)  # its head is gone: it retries
    wait_for(lambda: "waiting for the head at" in worker.output(), 30, "the worker retrying")
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(EXIT_S) == 0


def test_a_worker_without_its_head_gives_up_after_the_join_timeout(start_node) -> None:
    worker = start_node(WORKER, env={"SPARKPLE_LAB_JOIN_TIMEOUT_S": "1"})
    assert worker.proc.wait(30) == 1
    assert "could not join its head at 127.0.0.1:" in worker.output()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--headless"], "--headless: the lab serves one Spark"),
        (["--tensor-parallel-size=3", "--nnodes=2", "--node-rank=0"], "or a pair"),
        (["--tensor-parallel-size=2"], "or a pair"),
        (["--tensor-parallel-size=2", "--nnodes=2", "--node-rank=2", "--headless"], "or a pair"),
        (["--tensor-parallel-size=2", "--nnodes=2", "--node-rank=0", "--headless"],
         "--headless with --node-rank 0"),
        (["--tensor-parallel-size=2", "--nnodes=2", "--node-rank=1"], "without --headless"),
        (["--tensor-parallel-size=2", "--nnodes=2", "--node-rank=0",
          "--distributed-executor-backend=ray"], "mp engine"),
        (["--tensor-parallel-size=2", "--nnodes=2", "--node-rank=0", "--master-port=70000"],
         "use a TCP port"),
    ],
    ids=["headless-alone", "tp-3", "tp-2-one-node", "rank-2", "headless-head",
         "worker-with-api", "ray", "bad-port"],
)  # fmt: skip
def test_multi_node_flags_outside_a_pair_are_refused(args: list[str], says: str) -> None:
    proc = refused(*args)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
