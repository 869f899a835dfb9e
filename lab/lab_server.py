"""sparkple lab server: a stand-in for vLLM in the lab's serving image. It is NOT vLLM.

The lab target has no GB10 GPU, so the real engine cannot start. This server takes the
place of the image's entrypoint so that the service, its bind mounts, its health gate and
the operations units are exercised for real. Like vLLM's OpenAI server it is two processes:

- the engine (a child process) checks the patched vLLM files mounted over the image's own
  against their manifest, opens the packed PLE table named by SPARKPLE_PLE_TABLE_DIR
  through `sparkple.runtime.table` (the package bind-mounted read-only, as for vLLM) with the
  geometry of the mounted model's config.json, then serves completions on a unix socket: the
  prompt's UTF-8 bytes become token ids, their PLE rows are looked up in the table (row ids
  from `sparkple.runtime.ngram`, the gather from `sparkple.runtime.gather`, the NVFP4 decode
  from `sparkple.runtime.nvfp4`) and each next "token" is derived from the decoded rows. The
  text means nothing; the lookups are real.
- the API front answers `GET /health` itself: 200 once the engine reported both checks good,
  503 with the reason otherwise. It hands each `POST /v1/completions` to the engine, which
  sends the tokens back one at a time, and answers 504 when the engine does not send the next
  within the engine timeout. So a stopped engine (SIGSTOP) looks like a wedged vLLM engine:
  /health 200 while generations fail.
- `"stream": true` is answered as vLLM answers it: server-sent events, one `data:` chunk per
  token (the last one with its finish_reason), a usage chunk when
  `stream_options.include_usage` asks for one, then `data: [DONE]`. An engine failure after
  the first token is an error chunk, then `data: [DONE]`, as in vLLM.
- like vLLM's scheduler, at most --max-num-seqs requests run at a time (default 256); the
  others wait. `GET /metrics` shows both counts under vLLM's names
  (`vllm:num_requests_running`, `vllm:num_requests_waiting`), which is what a drain waits on.
  A request counts from its arrival until its last byte is written.

SIGTERM, to the front or to both processes, stops both cleanly (exit 0). An engine that dies
otherwise after it was ready makes the front exit 1, so that the supervisor sees a dead server.

It answers `/v1/models`, `/v1/completions` and `/v1/chat/completions` in the shape vLLM's
OpenAI server answers them (a request for another model name is a 404, as in vLLM).

A pair (two Sparks at TP 2, sparkple.serving.pair) is `--tensor-parallel-size 2 --nnodes 2`
with `--node-rank 0` on the head and `--node-rank 1 --headless` on the worker, both with
`--master-addr` and `--master-port` (vLLM's defaults 127.0.0.1 and 29501); any other
multi-node set-up is refused (exit 2). Modelled on vLLM 0.33.0's multiproc executor across
two nodes (docs/tensor-parallel.md; the link itself is lab_pair.py):
- the head's engine listens on --master-port (all addresses) for its worker once its table is
  open. /health answers 503 "waiting for node 1 of the pair at <addr>:<port>" until the worker
  joined, then 200 while it stays connected; a second worker is refused. When the worker goes
  (its connection closes, or its heartbeat stops for 3 s: a SIGSTOPped worker), /health
  answers 503 and generations fail at once, and the engine exits 1 after
  SPARKPLE_LAB_PEER_TIMEOUT_S, so the front exits 1: vLLM's head notices only when a step needs
  the worker, its engine core dies once the step's RPC times out
  (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s: envs.py:1863-1865, multiproc_executor.py:414),
  and its API server then exits (entrypoints/launchers/launcher.py:325-337). Unlike vLLM,
  whose /health stays 200 until then (entrypoints/serve/instrumentator/health.py:30), the lab
  says 503 at once.
- the worker serves no HTTP (vLLM's headless node runs only its executor,
  entrypoints/cli/serve.py:218-233): one process that opens its table, joins the head (retrying
  until SPARKPLE_LAB_JOIN_TIMEOUT_S, then exit 1) and, when the head goes, stays up: vLLM's
  worker waits for the next step with no timeout (v1/executor/multiproc_executor.py:1159) and
  nothing on its node watches the head. It never joins another head (restart it); SIGTERM
  stops it (exit 0).
- on joining, the two exchange their release (SPARKPLE_RELEASE_ID and
  SPARKPLE_PATCH_MANIFEST_SHA256), their table's fingerprint and fields and their config.json's
  sha256: a difference makes both exit 1 with a message naming both nodes and what differs,
  as the real patch's rank check does (sparkple/runtime/rankcheck.py).

Its command line is the subset of `vllm serve`'s that the service's unit passes (ACCEPTED_FLAGS
of the serving recipe, sparkple.serving.recipe; tests/vllm checks each flag against vLLM
0.33.0's own parser): anything else is refused like vLLM refuses an unknown argument (exit 2),
and JSON-valued flags must be valid JSON, so a unit that mangles an argument fails in the lab
too. The lab's own knobs are env vars:
SPARKPLE_LAB_ENGINE_TIMEOUT_S, the bound on each reply of the engine (seconds, default 30), and
SPARKPLE_LAB_TOKEN_DELAY_S, the time the engine takes per token (seconds, default 0), so that a
generation can last as long as a real one, and SPARKPLE_LAB_HEALTH_FAIL_FILE, a path: while a
file is there, /health answers 503 as vLLM's does once its engine core died (the operations
tests turn it on and off under a running server). A pair's: SPARKPLE_LAB_PEER_TIMEOUT_S, how
long a head's engine lives on after its worker went (seconds, default 2; vLLM's step timeout),
and SPARKPLE_LAB_JOIN_TIMEOUT_S, how long a worker tries to reach its head (seconds, default
600).
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import importlib.util
import json
import multiprocessing
import os
import shutil
import signal
import socket
import socketserver
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from lab_metrics import ServingMetrics  # beside this file, as in the lab images
from lab_pair import (
    WORKER,
    Link,
    PairRefused,
    accept_worker,
    hello,
    join_head,
    listen,
    refuse_others,
)

from sparkple.errors import SparkpleError
from sparkple.geometry import PLEGeometry
from sparkple.runtime.gather import gather_rows
from sparkple.runtime.ngram import row_ids
from sparkple.runtime.nvfp4 import dequantize_rows
from sparkple.runtime.stats import PLEStats, StatsFile
from sparkple.runtime.table import PackedTable, open_table
from sparkple.runtime.tablemeta import read_meta
from sparkple.serving.pair import PAIR_FLAGS  # the multi-node flags a pair adds
from sparkple.serving.recipe import ACCEPTED_FLAGS  # the flags the serving plan may write

# The patch output directory the service mounts read-only next to the patched files.
PATCH_DIR = Path(os.environ.get("SPARKPLE_PATCH_DIR", "/opt/sparkple/patches"))
# Seconds a stopped engine gets to exit after SIGTERM before it is killed (docker's grace is 30).
ENGINE_STOP_GRACE_S = 5.0
# Seconds between rewrites of the engine's PLE stats file (the patched backend's interval).
STATS_INTERVAL_S = 5.0
# vLLM's default --max-num-seqs (the requests the scheduler runs at once).
DEFAULT_MAX_NUM_SEQS = 256
# vLLM's defaults for the rendezvous of a multi-node engine (config/parallel.py, ParallelConfig).
DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT = "127.0.0.1", 29501


class PairSide(NamedTuple):
    """This node's place in a pair (from the multi-node flags) and the lab's bounds on it.
    (Not a dataclass: tests/vllm loads this script under another name, unregistered, where a
    dataclass cannot resolve its annotations.)"""

    rank: int
    master_addr: str
    master_port: int
    peer_timeout_s: float  # the head's engine dies this long after its worker went
    join_timeout_s: float  # the worker gives up reaching its head after this long

    @property
    def rendezvous(self) -> str:
        return f"{self.master_addr}:{self.master_port}"


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
                time.sleep(token_delay_s)  # the time a real decode step takes
            tokens.append(nxt)
            yield nxt


def log(message: str) -> None:
    print(f"lab_server: {message}", flush=True)


# --- the engine process ---------------------------------------------------------------------


def send_json(handler: BaseHTTPRequestHandler, code: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class EngineServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True

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


# --- the API front --------------------------------------------------------------------------


class EngineConnection(http.client.HTTPConnection):
    """HTTP to the engine over its unix socket; every send and receive is bounded by timeout."""

    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("lab-engine", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class State:
    ready: bool = False
    problem: str = "starting: the engine is opening the table"
    model: str = ""
    patches: str = ""
    socket_path: str = ""
    model_root: str = ""
    max_model_len: int = 0
    started: int = int(time.time())
    engine_timeout_s: float = 30.0
    stopping: bool = False
    exit_code: int = 0
    # one thread at a time reaps the engine: two waitpid()s race, and one sees it still alive
    reap_lock = threading.Lock()

    def __init__(self, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> None:
        # the scheduler's slots: a request runs while it holds one and waits for one before
        self.slots = threading.BoundedSemaphore(max_num_seqs)
        self.counts_lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        # tokens, finished requests and time to first token (the model name is set in main)
        self.metrics = ServingMetrics("")

    def count(self, running: int = 0, waiting: int = 0) -> None:
        with self.counts_lock:
            self.running += running
            self.waiting += waiting


class EngineError(Exception):
    """The engine failed a request: (HTTP status, message)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def engine_steps(state: State, prompt: str, max_tokens: int) -> Iterator[dict[str, Any]]:
    """The engine's lines for one request: {"token", "text"} each, then {"done", ...}.

    Raises EngineError: 504 when the engine sends nothing within the engine timeout, 503 when it
    cannot be reached, 500 when it reports a failure."""
    conn = EngineConnection(state.socket_path, state.engine_timeout_s)
    try:
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens})
        conn.request("POST", "/complete", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        while True:
            raw = reply.readline()
            if not raw:
                raise EngineError(500, "the engine closed the stream before it finished")
            line = json.loads(raw)
            if "error" in line:
                raise EngineError(500, line["error"])
            yield line
            if line.get("done"):
                return
    except TimeoutError:
        raise EngineError(
            504, f"the engine did not answer within {state.engine_timeout_s} s"
        ) from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise EngineError(503, f"the engine is unreachable: {type(exc).__name__}: {exc}") from None
    finally:
        conn.close()


def metrics_text(state: State) -> str:
    """vLLM's series under its names and labels (vllm/v1/metrics/loggers.py; lab_metrics)."""
    with state.counts_lock:
        running, waiting = state.running, state.waiting
    return state.metrics.render(running, waiting)


def openai_error(handler: BaseHTTPRequestHandler, code: int, message: str, kind: str) -> None:
    """An error in the shape vLLM's OpenAI server sends."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    send_json(handler, code, body)


def chat_prompt(messages: Any) -> str:
    """The text of a chat's messages (a stand-in for the chat template)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    parts = []
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError("each message needs a role")
        content = message.get("content") or ""
        if isinstance(content, list):  # content parts: keep the text ones
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"{message['role']}: {content}")
    return "\n".join(parts)


class Reply:
    """One completion's answer in vLLM's shapes: a JSON body, or server-sent events."""

    def __init__(
        self,
        handler: BaseHTTPRequestHandler,
        state: State,
        chat: bool,
        stream: bool,
        include_usage: bool,
    ) -> None:
        self.handler, self.state, self.chat = handler, state, chat
        self.stream, self.include_usage = stream, include_usage
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-lab-{time.time_ns()}"
        self.created = int(time.time())
        self.arrived = time.monotonic()  # vLLM's time to first token includes the queue

    def envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.state.model,
            "choices": choices,
        }

    def event(self, body: dict[str, Any] | str) -> None:
        data = body if isinstance(body, str) else json.dumps(body)
        self.handler.wfile.write(f"data: {data}\n\n".encode())
        self.handler.wfile.flush()

    def chunk(self, text: str | None, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None}
            kind = "text_completion"
        choice.update(finish_reason=finish_reason, stop_reason=None)
        return self.envelope(kind, [choice])

    def send(self, prompt: str, max_tokens: int) -> None:
        steps = engine_steps(self.state, prompt, max_tokens)
        texts: list[str] = []
        try:
            # the first token (or the engine's failure) before any header: an engine that is
            # down or wedged is an HTTP error, as a request vLLM cannot start
            first = next(steps)
        except EngineError as exc:
            send_json(self.handler, exc.code, {"error": str(exc)})
            return
        self.state.metrics.observe_ttft(time.monotonic() - self.arrived)
        if self.stream:
            self.handler.send_response(200)
            self.handler.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.handler.send_header("Cache-Control", "no-cache")
            self.handler.end_headers()  # HTTP/1.0: the stream ends when the connection closes
            if self.chat:
                self.event(self.chunk(None, None))  # vLLM's first chat chunk: the role
        line = first
        try:
            while not line.get("done"):
                texts.append(line["text"])
                if self.stream:  # the last token's chunk carries the finish reason
                    last = len(texts) == max_tokens  # the lab has no EOS: always max_tokens
                    self.event(self.chunk(line["text"], "length" if last else None))
                line = next(steps)
        except EngineError as exc:
            if not self.stream:
                send_json(self.handler, exc.code, {"error": str(exc)})
                return
            error = {"message": str(exc), "type": "InternalServerError", "code": exc.code}
            self.event({"error": error})
            self.event("[DONE]")
            return
        prompt_tokens = max(1, len(prompt.encode("utf-8")))
        self.state.metrics.count_finished(prompt_tokens, line["tokens"], "length")
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": line["tokens"],
            "total_tokens": prompt_tokens + line["tokens"],
        }
        if self.stream:
            if self.include_usage:
                kind = "chat.completion.chunk" if self.chat else "text_completion"
                self.event({**self.envelope(kind, []), "usage": usage})
            self.event("[DONE]")
            return
        text = "".join(texts)
        if self.chat:
            message = {
                "role": "assistant",
                "content": text,
                "reasoning_content": None,
                "tool_calls": [],
            }
            choice = {"index": 0, "message": message, "logprobs": None}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
            kind = "text_completion"
        choice["finish_reason"] = "length"
        lab = {
            "stand_in": "sparkple lab server, not vLLM",
            "ple_rows_gathered": line["rows_gathered"],
            "table": line["table"],
        }
        body = {**self.envelope(kind, [choice]), "usage": usage, "sparkple_lab": lab}
        send_json(self.handler, 200, body)


def make_handler(state: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:
            sys.stderr.write("lab_server: " + (fmt % args) + "\n")

        def _authorized(self) -> bool:
            key = os.environ.get("VLLM_API_KEY", "")
            if key and self.headers.get("Authorization", "") != f"Bearer {key}":
                send_json(self, 401, {"error": "Unauthorized"})
                return False
            return True

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/health":
                failing = os.environ.get("SPARKPLE_LAB_HEALTH_FAIL_FILE", "")
                if failing and os.path.exists(failing):
                    send_json(self, 503, {"error": f"the engine core is dead ({failing} exists)"})
                elif state.ready:
                    send_json(self, 200, {"status": "ok", "patches": state.patches})
                else:
                    send_json(self, 503, {"error": state.problem})
            elif self.path == "/metrics":  # like vLLM's, not behind the API key
                data = metrics_text(state).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            elif self.path == "/v1/models":
                if self._authorized():
                    card = {
                        "id": state.model,
                        "object": "model",
                        "created": state.started,
                        "owned_by": "vllm",
                        "root": state.model_root,
                        "parent": None,
                        "max_model_len": state.max_model_len or None,
                    }
                    send_json(self, 200, {"object": "list", "data": [card]})
            else:
                send_json(self, 404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            chat = self.path == "/v1/chat/completions"
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                send_json(self, 404, {"error": f"no route {self.path}"})
                return
            if not self._authorized():
                return
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                if not isinstance(req, dict):
                    raise ValueError("the body must be a JSON object")
                prompt = chat_prompt(req.get("messages")) if chat else str(req.get("prompt", ""))
                limit = req.get("max_completion_tokens") if chat else None
                max_tokens = int(limit if limit is not None else req.get("max_tokens", 16))
            except (ValueError, TypeError) as exc:
                openai_error(self, 400, f"bad request body: {exc}", "BadRequestError")
                return
            model = req.get("model")
            if model is not None and model != state.model:
                openai_error(self, 404, f"The model `{model}` does not exist.", "NotFoundError")
                return
            if not 1 <= max_tokens <= 256:
                openai_error(self, 400, "max_tokens must be in 1..256", "BadRequestError")
                return
            if not state.ready:
                send_json(self, 503, {"error": state.problem})
                return
            stream = req.get("stream") is True
            options = req.get("stream_options") or {}
            reply = Reply(self, state, chat, stream, bool(options.get("include_usage")))
            state.count(waiting=1)
            state.slots.acquire()
            state.count(waiting=-1, running=1)
            try:
                reply.send(prompt, max_tokens)
            except (BrokenPipeError, ConnectionResetError):
                log(f"the client of {reply.id} went away")
            finally:
                state.count(running=-1)
                state.slots.release()

    return Handler


def wait_for_exit(state: State, engine: multiprocessing.process.BaseProcess) -> None:
    wait([engine.sentinel])  # readable once it exits; no waitpid() here
    with state.reap_lock:
        engine.join()


def watch_engine(
    state: State, engine: multiprocessing.process.BaseProcess, ready: Connection, server: Any
) -> None:
    """Take the engine's reports; once it was ready, its death stops the front."""
    was_ready = False
    while True:
        try:
            report = ready.recv()
        except EOFError:  # the engine exited
            if was_ready:
                break
            report = {"problem": "the engine exited before it reported"}
        if "problem" in report:
            # the server stays up with /health 503 and the reason, for the health gate to show
            state.problem = report["problem"]
            log(f"not healthy: {state.problem}")
            wait_for_exit(state, engine)
            return
        if "refused" in report:
            # the pair's nodes disagree: the head refuses to start, as vLLM's server exits when
            # its engine core fails at load
            state.problem = report["refused"]
            log(f"refused: {state.problem}")
            wait_for_exit(state, engine)
            if not state.stopping:
                state.exit_code = 1
                server.shutdown()
            return
        if "waiting" in report:  # a pair's head, its table open, waits for its worker
            state.problem = report["waiting"]
        elif "lost" in report:  # its worker went: the engine is dead and will exit
            state.ready, state.problem = False, report["lost"]
        else:
            state.patches, state.problem, state.ready = report["patches"], "", True
            was_ready = True
    wait_for_exit(state, engine)
    if not state.stopping:
        state.ready, state.problem = False, f"the engine exited with code {engine.exitcode}"
        log(f"{state.problem}; stopping")
        # exit 0 is a stop asked for (SIGTERM to the whole service, as systemd sends it); any
        # other end is a dead engine, which the supervisor must see
        state.exit_code = 0 if engine.exitcode == 0 else 1
        server.shutdown()


def stop_engine(state: State, engine: multiprocessing.process.BaseProcess) -> None:
    with state.reap_lock:
        if engine.is_alive() and engine.pid is not None:
            engine.terminate()
            # a stopped (SIGSTOPped) engine acts on SIGTERM only once continued, as systemd does
            os.kill(engine.pid, signal.SIGCONT)
            engine.join(ENGINE_STOP_GRACE_S)
        if engine.is_alive():
            log(f"the engine did not exit within {ENGINE_STOP_GRACE_S} s of SIGTERM; killing it")
            engine.kill()
        engine.join()


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """vLLM's flags the unit passes; exit 2 on anything else, as `vllm serve` does."""
    parser = argparse.ArgumentParser(
        prog="lab_server.py", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    parser.add_argument("model_tag", nargs="?", help="the model directory (as `vllm serve`)")
    for flag, kind in {**ACCEPTED_FLAGS, **PAIR_FLAGS}.items():
        if kind is None:
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=json_object if kind == "json" else kind)
    args = parser.parse_args(argv)
    args.model = args.model_tag or args.model
    if not args.model:
        parser.error("no model: pass the model directory first (or --model)")
    if args.host is None:
        args.host = "127.0.0.1"
    if args.port is None:
        args.port = 8000
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser (as vLLM)")
    args.engine_timeout_s = env_seconds(parser, "SPARKPLE_LAB_ENGINE_TIMEOUT_S", 30)
    args.token_delay_s = env_seconds(parser, "SPARKPLE_LAB_TOKEN_DELAY_S", 0, zero_ok=True)
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        parser.error("--max-num-seqs must be >= 1 (as vLLM)")
    args.pair = pair_side(parser, args)
    return args


def env_seconds(
    parser: argparse.ArgumentParser, name: str, default: float, zero_ok: bool = False
) -> float:
    try:
        value = float(os.environ.get(name, str(default)))
    except ValueError:
        parser.error(f"{name} must be a number of seconds")
    if value < 0 or (value == 0 and not zero_ok):
        parser.error(f"{name} must be {'>= 0' if zero_ok else '> 0'}")
    return value


def pair_side(parser: argparse.ArgumentParser, args: argparse.Namespace) -> PairSide | None:
    """None for one Spark; this node's side for a pair (TP 2 over --nnodes 2); exit 2 for any
    other multi-node set-up, which the lab does not stand in for."""
    tp, nnodes, rank = args.tensor_parallel_size, args.nnodes, args.node_rank
    if (
        tp in (None, 1)
        and nnodes in (None, 1)
        and rank in (None, 0)
        and not args.headless
        and args.master_addr is None
        and args.master_port is None
    ):
        return None
    if tp != 2 or nnodes != 2 or rank not in (0, 1):
        values = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in PAIR_FLAGS}
        given = " ".join(
            flag if value is True else f"{flag} {value}"
            for flag, value in values.items()
            if value is not None and value is not False
        )
        parser.error(
            f"{given}: the lab serves one Spark (none of the multi-node flags) or a pair: "
            "--tensor-parallel-size 2 --nnodes 2 and --node-rank 0 (the head) or 1 (the "
            "worker, with --headless)"
        )
    if args.headless and rank != WORKER:
        # vLLM 0.33 starts a headless node of rank 0 as data-parallel engines that wait for an
        # API server elsewhere (entrypoints/cli/serve.py:218-264), which a pair never runs
        parser.error(
            "--headless with --node-rank 0: the head of a pair serves the API; only node 1, "
            "the worker, is --headless"
        )
    if rank == WORKER and not args.headless:
        parser.error(
            "--node-rank 1 without --headless: the worker of a pair serves no API (the head "
            "does); add --headless"
        )
    if args.distributed_executor_backend not in (None, "mp"):
        parser.error(
            f"--distributed-executor-backend {args.distributed_executor_backend}: a pair runs "
            "on vLLM's multi-node mp engine (--distributed-executor-backend mp)"
        )
    port = DEFAULT_MASTER_PORT if args.master_port is None else args.master_port
    if not 1 <= port <= 65535:
        parser.error(f"--master-port {port}: use a TCP port (1-65535)")
    return PairSide(
        rank=rank,
        master_addr=args.master_addr or DEFAULT_MASTER_ADDR,
        master_port=port,
        peer_timeout_s=env_seconds(parser, "SPARKPLE_LAB_PEER_TIMEOUT_S", 2),
        join_timeout_s=env_seconds(parser, "SPARKPLE_LAB_JOIN_TIMEOUT_S", 600),
    )


def worker_main(args: argparse.Namespace) -> int:
    """Node 1 of a pair (--headless): no API server, as vLLM's headless node runs only its
    executor (entrypoints/cli/serve.py:218-233). It opens its table, joins the head at
    --master-addr:--master-port, and when the head goes it does not exit: vLLM's worker waits
    for the next step with no timeout (v1/executor/multiproc_executor.py:1159) and nothing on
    its node watches the head (docs/tensor-parallel.md). It never joins another head: it must
    be restarted. SIGTERM stops it (exit 0)."""
    pair = args.pair

    def on_sigterm(*_: Any) -> None:
        log("SIGTERM: stopping node 1")
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    model_dir = Path(args.model)
    try:
        patches = check_patches()
        table_dir = table_dir_from_env()
        engine = Engine(model_dir, table_dir)
        own = hello(pair.rank, model_dir, table_dir, engine.table.meta)
    except (SparkpleError, OSError, KeyError, ValueError) as exc:
        log(f"node 1 cannot serve: {type(exc).__name__}: {exc}")
        return 1
    log(f"node 1 (pid {os.getpid()}, headless): {patches}; table {table_dir} open")
    try:
        link = join_head(pair.master_addr, pair.master_port, own, pair.join_timeout_s, log)
    except PairRefused as exc:
        log(f"refused: {exc}")
        return 1
    log(f"joined the pair: its head is {link.describe()}")
    head_gone = threading.Event()

    def lost(why: str) -> None:
        log(
            f"the head, {link.describe()}, is gone ({why}); node 1 waits for a next step that "
            "will not come, as vLLM's headless node does: restart it to join a new head"
        )
        head_gone.set()

    link.watch(lost)
    head_gone.wait()
    threading.Event().wait()  # until SIGTERM
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pair is not None and args.pair.rank == WORKER:
        return worker_main(args)

    # PID 1 in a container ignores SIGTERM unless it handles it: `docker stop` must stop us,
    # also while the engine starts. SystemExit unwinds to the `finally` that stops the engine.
    def on_sigterm(*_: Any) -> None:
        log("SIGTERM: stopping the engine")
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    state = State(args.max_num_seqs or DEFAULT_MAX_NUM_SEQS)
    state.model = args.served_model_name or args.model
    state.metrics.model_name = state.model
    state.engine_timeout_s = args.engine_timeout_s
    state.max_model_len = args.max_model_len or 0
    state.model_root = args.model
    log(f"a stand-in for vLLM serving {args.model} as {state.model}")
    socket_dir = tempfile.mkdtemp(prefix="sparkple-lab-")
    state.socket_path = os.path.join(socket_dir, "engine.sock")
    # fork before any thread or listening socket exists, so the engine inherits neither
    mp = multiprocessing.get_context("fork")
    ready_rx, ready_tx = mp.Pipe(duplex=False)
    engine = mp.Process(
        target=engine_main,
        args=(Path(args.model), state.socket_path, ready_tx, args.token_delay_s, args.pair),
        name="engine",
    )
    engine.start()
    ready_tx.close()
    try:
        server = ThreadingHTTPServer((args.host, args.port), make_handler(state))
        server.daemon_threads = True
        threading.Thread(
            target=watch_engine, args=(state, engine, ready_rx, server), daemon=True
        ).start()
        log(f"listening on {args.host}:{args.port}, engine pid {engine.pid}")
        server.serve_forever()
    finally:
        state.stopping = True
        stop_engine(state, engine)
        shutil.rmtree(socket_dir, ignore_errors=True)
    return state.exit_code


if __name__ == "__main__":
    sys.exit(main())
