"""The lab server's front process (see lab_server.py): its command line (the `vllm serve` flags
the unit passes, a pair's side of them, the lab's env vars), the engine child it forks, watches
and stops, and main, which runs either that front with its API server or a pair's headless
worker. It is NOT vLLM.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
from http.server import ThreadingHTTPServer
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from lab_api import DEFAULT_MAX_NUM_SEQS, State, make_handler
from lab_engine import engine_main, log
from lab_pair import WORKER, PairSide
from lab_worker import worker_main

from sparkple.serving.recipe import (
    ACCEPTED_FLAGS,  # the flags the serving plan may write
    PAIR_FLAGS,  # the multi-node flags a pair adds
)

# The first line of lab_server.py's docstring: `--help` describes the server, not this module.
DESCRIPTION = "sparkple lab server: a stand-in for vLLM in the lab's serving image. It is NOT vLLM."
# Seconds a stopped engine gets to exit after SIGTERM before it is killed (docker's grace is 30).
ENGINE_STOP_GRACE_S = 5.0
# vLLM's defaults for the rendezvous of a multi-node engine (config/parallel.py, ParallelConfig).
DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT = "127.0.0.1", 29501


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
        prog="lab_server.py", description=DESCRIPTION, allow_abbrev=False
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
