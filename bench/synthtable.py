"""The benchmarks' synthetic table: about `gib` GiB with the real row geometry, built once.

A published table of the wanted size in `work/table-<gib>gib` is reused; otherwise a synthetic
checkpoint is written (sparkple.builder.synth) and packed (sparkple.builder.build). The checkpoint's
config.json is kept beside the table as `config-<gib>gib.json` for the benchmarks that build
vLLM's layer from it.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from measure import log

from sparkple.builder.build import build_table
from sparkple.builder.synth import synth_checkpoint, vocab_base_for_bytes
from sparkple.errors import TableError
from sparkple.runtime.tablemeta import read_meta


def ensure_table(work: Path, gib: float, keep_snapshot: bool = False) -> tuple[Path, Path, bool]:
    """(table dir, its config.json, whether it was reused)."""
    target = int(gib * 2**30)
    table_dir = work / f"table-{gib:g}gib"
    config = work / f"config-{gib:g}gib.json"
    try:
        meta = read_meta(table_dir)
        if abs(meta.data_bytes - target) <= 0.1 * target and config.is_file():
            return table_dir, config, True
    except TableError:
        pass
    snap = work / "snapshot"
    shutil.rmtree(snap, ignore_errors=True)
    log(f"building a {gib:g} GiB synthetic table in {table_dir} ...")
    t0 = time.perf_counter()
    synth_checkpoint(snap, vocab_base=vocab_base_for_bytes(target), files=max(2, int(gib)))
    build_table(snap, table_dir, force=True, quiet=True)
    shutil.copy(snap / "config.json", config)
    if not keep_snapshot:
        shutil.rmtree(snap)
    log(f"built in {time.perf_counter() - t0:.0f} s")
    return table_dir, config, False
