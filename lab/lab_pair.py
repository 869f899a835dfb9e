"""The link between the two nodes of a lab pair (lab_server.py with --nnodes 2). It is NOT vLLM.

On a real pair the head's workers and the worker node's rendezvous at --master-addr and
--master-port (vLLM 0.33.0, distributed/parallel_state.py:1875-1878) and the head then drives
every step over a remote message queue (v1/executor/multiproc_executor.py:718-743). Here the
worker connects to the head's --master-port over TCP, and the wire is tiny:

- the hello, one JSON line each way (the worker's first, then the head's): the node's rank, host,
  release id and patch manifest sha256 (SPARKPLE_RELEASE_ID, SPARKPLE_PATCH_MANIFEST_SHA256, as
  the unit sets them), table directory, the table's fingerprint and fingerprinted fields
  (sparkple.runtime.tablemeta) and the sha256 of the model's config.json. Both sides compare
  them as the real patch's rank check does (sparkple/runtime/rankcheck.py, whose release
  comparison they call) and refuse a pair that differs, naming both;
- then a heartbeat, one newline every HEARTBEAT_S each way. A side that hears nothing for
  PEER_SILENCE_S takes its peer as gone: a SIGKILLed peer closes the connection, but a SIGSTOPped
  one (or a half-open connection) would otherwise never be noticed.

A head that already has its worker answers any other connection with one refusal line
({"refused": why}) and closes it.

Once a pair has formed, each node prints the init lines NCCL would log for the transport its
environment selects (`announce_network`), so that the head's transport check has something real
to read in the unit's journal. That is the lab's model of NCCL, not NCCL.

PairSide is a node's place in the pair, as the front reads it from the multi-node flags.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from sparkple.errors import SparkpleError
from sparkple.runtime.rankcheck import Release, release_mismatch
from sparkple.runtime.tablemeta import TableMeta

HEAD, WORKER = 0, 1
HEARTBEAT_S = 0.25
# A peer silent this long is gone. Not less: with three scenarios and pytest at once on a 2-core
# CI machine, a lab pair's head took its live worker for gone twice, most likely a heartbeat
# thread left unscheduled for over a second (vLLM's own head waits out a 300 s step timeout).
PEER_SILENCE_S = 3.0
# How long a connected peer gets to send its hello line.
HELLO_TIMEOUT_S = 5.0
# Pause between the worker's attempts to reach its head.
JOIN_RETRY_S = 0.2


class PairRefused(SparkpleError):
    """The two nodes cannot serve together (the message names both); the node exits 1."""


class PairSide(NamedTuple):
    """This node's place in a pair (from the multi-node flags) and the lab's bounds on it."""

    rank: int
    master_addr: str
    master_port: int
    peer_timeout_s: float  # the head's engine dies this long after its worker went
    join_timeout_s: float  # the worker gives up reaching its head after this long

    @property
    def rendezvous(self) -> str:
        return f"{self.master_addr}:{self.master_port}"


def node_name(rank: int) -> str:
    return f"node {rank} ({'head' if rank == HEAD else 'worker'})"


def hello(rank: int, model_dir: Path, table_dir: Path, meta: TableMeta) -> dict[str, Any]:
    """This node's side of the exchange."""
    config = (model_dir / "config.json").read_bytes()
    return {
        "sparkple_lab_pair": 1,
        "rank": rank,
        "host": socket.gethostname(),
        **Release.from_env().entry(),
        "model": str(model_dir),
        "config_sha256": hashlib.sha256(config).hexdigest(),
        "table_dir": str(table_dir),
        "snapshot": meta.source.snapshot_id,
        "fingerprint": meta.fingerprint(),
        "fields": meta.fingerprinted(),
    }


def _side(entry: dict[str, Any]) -> str:
    return (
        f"{node_name(entry['rank'])} on {entry['host']} (model {entry['model']}, table "
        f"{entry['table_dir']}, snapshot {entry['snapshot']}, fingerprint "
        f"{entry['fingerprint'][:16]})"
    )


def check_pair(head: dict[str, Any], worker: dict[str, Any]) -> None:
    """PairRefused unless both nodes run one release and serve the same table of the same
    model config."""
    mismatch = release_mismatch(
        (f"{node_name(head['rank'])} on {head['host']}", Release.of(head)),
        (f"{node_name(worker['rank'])} on {worker['host']}", Release.of(worker)),
    )
    if mismatch:
        raise PairRefused(f"the pair's nodes run different releases: {mismatch}")
    differ = sorted(
        key
        for key in set(head["fields"]) | set(worker["fields"])
        if head["fields"].get(key) != worker["fields"].get(key)
    )
    if head["fingerprint"] != worker["fingerprint"]:
        raise PairRefused(
            f"the pair's nodes serve different PLE tables: {_side(head)} and {_side(worker)} "
            f"differ in {', '.join(differ) or 'fingerprint'}. Summing their rows would garble "
            "the output: build both tables from the same checkpoint revision (`sparkple "
            "build-table SNAPSHOT OUT_DIR --force` on each node) before starting the pair"
        )
    if head["config_sha256"] != worker["config_sha256"]:
        raise PairRefused(
            f"the pair's nodes load different model configs: {_side(head)} has config.json "
            f"sha256 {head['config_sha256'][:16]}, {_side(worker)} has "
            f"{worker['config_sha256'][:16]}: serve the same checkpoint revision on both nodes"
        )


def _read_line(sock: socket.socket, timeout_s: float) -> dict[str, Any] | None:
    """One JSON object line from sock, or None when it closes, is silent or sends no object."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while not data.endswith(b"\n"):
            chunk = sock.recv(1)  # byte by byte: nothing after the line is consumed
            if not chunk:
                return None
            data += chunk
    except OSError:  # including the timeout
        return None
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _send_line(sock: socket.socket, body: dict[str, Any]) -> None:
    sock.sendall(json.dumps(body).encode() + b"\n")


class Link:
    """The connection to the peer, once both hellos are exchanged and agree."""

    def __init__(self, sock: socket.socket, peer: dict[str, Any], address: str) -> None:
        self.sock, self.peer, self.address = sock, peer, address
        self._lost = threading.Event()
        self._lose_lock = threading.Lock()  # the heartbeat and the listener may both see it
        self._on_lost: Callable[[str], None] = lambda why: None

    def describe(self) -> str:
        return f"{node_name(self.peer['rank'])} on {self.peer['host']} ({self.address})"

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Heartbeats both ways; on_lost(why) once the peer closes or falls silent."""
        self._on_lost = on_lost
        threading.Thread(target=self._beat, name="pair-heartbeat", daemon=True).start()
        threading.Thread(target=self._listen, name="pair-listen", daemon=True).start()

    def _lose(self, why: str) -> None:
        with self._lose_lock:
            if self._lost.is_set():
                return
            self._lost.set()
        self.close()
        self._on_lost(why)

    def _beat(self) -> None:
        while not self._lost.wait(HEARTBEAT_S):
            try:
                self.sock.sendall(b"\n")
            except OSError as exc:
                self._lose(f"the connection failed ({type(exc).__name__}: {exc})")

    def _listen(self) -> None:
        self.sock.settimeout(PEER_SILENCE_S)
        while not self._lost.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                self._lose(f"it sent no heartbeat for {PEER_SILENCE_S} s")
                return
            except OSError as exc:
                self._lose(f"the connection failed ({type(exc).__name__}: {exc})")
                return
            if not data:
                self._lose("it closed the connection")
                return

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def announce_network(sock: socket.socket) -> None:
    """Print NCCL's init lines (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET) for the network
    NCCL_NET selects. The lab has no RDMA device: with NCCL_NET=IB, NCCL finds no IB device and,
    forced to that network, fails its init; so does this node."""
    if os.environ.get("NCCL_DEBUG", "").upper() != "INFO":
        return
    prefix = f"{socket.gethostname()}:{os.getpid()}:{threading.get_native_id()} [0] NCCL INFO"
    if os.environ.get("NCCL_NET", "").lower() == "ib":
        print(f"{prefix} NET/IB : No device found.", flush=True)
        raise PairRefused(
            "NCCL WARN Failed to initialize any NET plugin (NCCL_NET=IB and no RDMA device in "
            "the lab): a lab pair needs sparkple_pair_transport: socket"
        )
    interface = os.environ.get("NCCL_SOCKET_IFNAME", "eth0")
    print(f"{prefix} NET/Socket : Using [0]{interface}:{sock.getsockname()[0]}<0>", flush=True)
    print(f"{prefix} Using network Socket", flush=True)


def listen(port: int) -> socket.socket:
    """The head's rendezvous socket, on every address (as the TCP store at --master-port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", port))
    sock.listen(4)
    return sock


def accept_worker(listener: socket.socket, own: dict[str, Any]) -> Link:
    """Wait for the worker node: the first connection that sends a worker's hello. A connection
    that sends none in time is dropped and the wait goes on."""
    while True:
        listener.settimeout(None)
        sock, (host, port) = listener.accept()
        theirs = _read_line(sock, HELLO_TIMEOUT_S)
        if theirs is None or theirs.get("sparkple_lab_pair") != 1:
            sock.close()
            continue
        sock.settimeout(HELLO_TIMEOUT_S)
        try:
            if theirs.get("rank") != WORKER:
                _send_line(sock, {"refused": f"{node_name(HEAD)} takes only node {WORKER}"})
                sock.close()
                continue
            _send_line(sock, own)  # before the check, so that the worker can name both too
        except OSError:
            sock.close()
            continue
        try:
            check_pair(own, theirs)
            announce_network(sock)
        except PairRefused:
            sock.close()
            raise
        return Link(sock, theirs, f"{host}:{port}")


def refuse_others(listener: socket.socket, why: Callable[[], str]) -> None:
    """Answer every later connection with a refusal (in a thread, while the head runs)."""

    def loop() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            try:
                sock.settimeout(HELLO_TIMEOUT_S)
                _send_line(sock, {"refused": why()})
            except OSError:
                pass
            finally:
                sock.close()

    threading.Thread(target=loop, name="pair-refuse", daemon=True).start()


def join_head(
    addr: str, port: int, own: dict[str, Any], timeout_s: float, log: Callable[[str], None]
) -> Link:
    """Connect to the head, retrying until it answers or timeout_s has passed (PairRefused)."""
    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        try:
            sock = socket.create_connection((addr, port), timeout=HELLO_TIMEOUT_S)
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            try:
                _send_line(sock, own)
            except OSError as exc:
                theirs, last = None, f"{type(exc).__name__}: {exc}"
            else:
                theirs, last = _read_line(sock, HELLO_TIMEOUT_S), "the head sent no hello"
            if theirs is not None and "refused" in theirs:
                sock.close()
                why = theirs["refused"]
                raise PairRefused(f"the head at {addr}:{port} refused this node: {why}")
            if theirs is not None and theirs.get("sparkple_lab_pair") == 1:
                try:
                    check_pair(theirs, own)
                    announce_network(sock)
                except PairRefused:
                    sock.close()
                    raise
                return Link(sock, theirs, f"{addr}:{port}")
            sock.close()
        if time.monotonic() >= deadline:
            raise PairRefused(
                f"{node_name(WORKER)} could not join its head at {addr}:{port} within "
                f"{timeout_s} s ({last}): start the head, or check --master-addr and "
                "--master-port and the link between the nodes"
            )
        if not said:
            log(f"waiting for the head at {addr}:{port} ({last})")
            said = True
        time.sleep(JOIN_RETRY_S)
