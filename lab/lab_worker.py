"""Node 1 of a lab pair (see lab_server.py): the headless worker, one process that opens its
table, joins its head and outlives it. It is NOT vLLM.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path
from typing import Any

from lab_engine import Engine, check_patches, log, table_dir_from_env
from lab_pair import PairRefused, hello, join_head

from sparkple.errors import SparkpleError


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
