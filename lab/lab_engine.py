"""The lab server's engine process (see lab_server.py): the patch check it runs at start, the
PLE table and the lookups a completion does (Engine), the unix-socket server the front talks to
(one JSON line per token), and, on a pair's head, taking and watching its worker. It is NOT vLLM.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import signal
import socketserver
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
from lab_pair import Link, PairRefused, PairSide, accept_worker, hello, listen, refuse_others

from sparkple.errors import SparkpleError
from sparkple.geometry import PLEGeometry
from sparkple.runtime.gather import gather_rows
from sparkple.runtime.ngram import row_ids
from sparkple.runtime.nvfp4 import dequantize_rows
from sparkple.runtime.stats import PLEStats, StatsFile
from sparkple.runtime.table import PackedTable, open_table
from sparkple.runtime.tablemeta import read_meta

# The patch output directory the service mounts read-only next to the patched files.
PATCH_DIR = Path(os.environ.get("SPARKPLE_PATCH_DIR", "/opt/sparkple/patches"))
# Seconds between rewrites of the engine's PLE stats file (the patched backend's interval).
STATS_INTERVAL_S = 5.0


# every process of the server logs as "lab_server:", the name the units and their tests know
def log(message: str) -> None:
    print(f"lab_server: {message}", flush=True)


def vllm_dir() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SparkpleError("no vllm package in this image")
    return Path(spec.submodule_search_locations[0])


def check_patches() -> str:
    """Compare each patched file, as mounted over the image's vLLM, with the manifest."""
    manifest_path = PATCH_DIR / "manifest.json"
    if not manifest_path.is_file():
        raise SparkpleError(f"no patch manifest at {manifest_path}: the patches are not mounted")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    files = manifest.get("files", [])
    if not files:
        raise SparkpleError(f"{manifest_path} lists no patched files")
    root = vllm_dir()
    for entry in files:
        target = root / entry["path"]
        digest = hashlib.sha256(target.read_bytes()).hexdigest()
        if digest != entry["patched_sha256"]:
            raise SparkpleError(
                f"{target} has sha256 {digest}, the manifest says {entry['patched_sha256']}: "
                "the patched file is not mounted over the image's"
            )
    return f"{len(files)} patched files match {manifest_path}"


class Engine:
    """The table, its geometry, and the lookups a completion does."""

    def __init__(self, model_dir: Path, table_dir: Path) -> None:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        meta = read_meta(table_dir)  # the stored layout, before the table is mapped
        self.geometry = PLEGeometry.from_config(
            cfg,
            stored_multipliers=list(meta.multipliers),
            stored_head_sizes=list(meta.head_sizes),
            stored_head_offsets=list(meta.head_offsets),
        )
        g = self.geometry
        self.table: PackedTable = open_table(
            table_dir,
            expect={"total_rows": g.total_rows, "num_heads": g.num_heads, "head_dim": g.head_dim},
        )
        self.rows_gathered = 0
        # why the engine core is dead (a pair's head whose worker went), "" while it is not
        self.dead = ""
        # the backend's counters, in the stats file the metrics exporter reads (when the unit
        # names a stats directory, as the serving unit does for vLLM)
        self.stats = PLEStats()
        self.stats_file = StatsFile.from_env(self.stats)
        if self.stats_file is not None:
            self.stats_file.start(STATS_INTERVAL_S)

    def generate(self, prompt: str, max_tokens: int, token_delay_s: float) -> Iterator[int]:
        """Each next "token" (a printable byte), one PLE lookup and decode per step."""
        g = self.geometry
        meta = self.table.meta
        tokens = [b % g.vocab_size for b in prompt.encode("utf-8")] or [g.eos_token_id]
        ctx = np.full((1, g.ngram_size - 1), g.eos_token_id, dtype=np.int64)
        staging = np.empty((1, g.num_heads, meta.row_width), dtype=np.uint8)
        paced = time.monotonic()
        for _ in range(max_tokens):
            if self.dead:  # the step would need the other node
                raise SparkpleError(self.dead)
            ids = np.asarray(tokens, dtype=np.int64)
            qsl = np.asarray([0, ids.size], dtype=np.int64)
            rid = row_ids(ids, qsl, ctx, g)[-1:]  # the last token's rows
            gather_rows(self.table.rows, rid, staging)
            self.rows_gathered += int(rid.size)
            self.stats.add("rows_gathered", int(rid.size))
            self.stats.add("gather_calls")
            if meta.quant == "nvfp4":
                values = dequantize_rows(staging, meta.global_scale, meta.head_dim)
            else:
                values = staging.astype(np.float32)
            nxt = 32 + int(abs(float(values.sum())) * 1000) % 95  # a printable byte
            if token_delay_s > 0:
                # a real decode step's time, paced from the start (the step's own work inside
                # it): a loaded machine slows the lab's tokens only where that work outgrows it
                paced += token_delay_s
                time.sleep(max(paced - time.monotonic(), 0.0))
            tokens.append(nxt)
            yield nxt


class EngineServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    # socketserver's default backlog is 5: a Unix socket whose backlog is full refuses a
    # connect at once (EAGAIN, the front's timeout makes it non-blocking), which the front
    # answers 503; eight benchmark streams beside the gateway's checks on a loaded machine filled it
    request_queue_size = 128

    def __init__(self, path: str, engine: Engine, token_delay_s: float) -> None:
        self.engine = engine
        self.token_delay_s = token_delay_s
        self.exit_code = 0  # the engine process's, once serving stops
        super().__init__(path, EngineHandler)


class EngineHandler(BaseHTTPRequestHandler):
    """POST /complete {"prompt", "max_tokens"} -> one JSON line per token ({"token", "text"}),
    then {"done": true, "tokens", "rows_gathered", "table"}, or {"error"} where it failed."""

    server: EngineServer

    def log_message(self, fmt: str, *args: Any) -> None:
        pass  # the front logs each request

    def line(self, body: dict[str, Any]) -> None:
        self.wfile.write(json.dumps(body).encode() + b"\n")
        self.wfile.flush()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        engine = self.server.engine
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.end_headers()  # HTTP/1.0: the reply ends when the connection closes
        try:
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            steps = engine.generate(
                str(req["prompt"]), int(req["max_tokens"]), self.server.token_delay_s
            )
            count = 0
            for token in steps:
                self.line({"token": token, "text": chr(token)})
                count += 1
            self.line(
                {
                    "done": True,
                    "tokens": count,
                    "rows_gathered": engine.rows_gathered,
                    "table": str(engine.table.meta.data_file),
                }
            )
        except (BrokenPipeError, ConnectionResetError):
            pass  # the front gave up on this request
        except Exception as exc:  # noqa: BLE001 - any failure is the front's error, not a dead engine
            self.line({"error": f"engine: {type(exc).__name__}: {exc}"})


def table_dir_from_env() -> Path:
    table_dir = os.environ.get("SPARKPLE_PLE_TABLE_DIR", "")
    if not table_dir:
        raise SparkpleError("SPARKPLE_PLE_TABLE_DIR is not set")
    return Path(table_dir)


def engine_main(
    model_dir: Path,
    socket_path: str,
    ready: Connection,
    token_delay_s: float,
    pair: PairSide | None = None,
) -> None:
    """The engine process: check the patches, open the table, (a pair's head: take its worker,)
    tell the front, serve."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        patches = check_patches()
        table_dir = table_dir_from_env()
        engine = Engine(model_dir, table_dir)
        server = EngineServer(socket_path, engine, token_delay_s)
    except (SparkpleError, OSError, KeyError, ValueError) as exc:
        ready.send({"problem": f"{type(exc).__name__}: {exc}"})
        sys.exit(1)
    log(f"engine (pid {os.getpid()}): {patches}; table {table_dir} open")
    if pair is None:
        ready.send({"patches": patches})
    else:
        own = hello(pair.rank, model_dir, table_dir, engine.table.meta)
        take_worker(engine, server, ready, pair, own, patches)
    server.serve_forever()
    sys.exit(server.exit_code)


def take_worker(
    engine: Engine,
    server: EngineServer,
    ready: Connection,
    pair: PairSide,
    own: dict[str, Any],
    patches: str,
) -> Link:
    """A pair's head: wait for node 1 at --master-port, then watch it. vLLM's head notices a
    lost worker only when a step needs it, and its engine core dies once the step's RPC times
    out (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS; docs/tensor-parallel.md); the lab's engine fails
    every step at once and exits 1 after SPARKPLE_LAB_PEER_TIMEOUT_S."""
    try:
        listener = listen(pair.master_port)
    except OSError as exc:
        ready.send({"problem": f"cannot listen on --master-port {pair.master_port}: {exc}"})
        sys.exit(1)
    waiting = f"waiting for node 1 of the pair at {pair.rendezvous}"
    log(waiting)
    ready.send({"waiting": waiting})
    try:
        link = accept_worker(listener, own)
    except PairRefused as exc:
        ready.send({"refused": str(exc)})
        sys.exit(1)
    log(f"node 1 joined: {link.describe()}")
    refuse_others(
        listener, lambda: engine.dead or f"its node 1 is {link.describe()}; a pair has one worker"
    )
    ready.send({"patches": patches, "peer": link.describe()})

    def lost(why: str) -> None:
        engine.dead = f"the pair's {link.describe()} is gone ({why}): the engine core is dead"
        log(f"{engine.dead}; exiting in {pair.peer_timeout_s} s")
        ready.send({"lost": engine.dead})
        time.sleep(pair.peer_timeout_s)  # the step's RPC timeout, then the engine core dies
        server.exit_code = 1
        server.shutdown()

    link.watch(lost)
    return link
