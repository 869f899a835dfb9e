"""A small real table, built once per session through the real synth + build path.

pytest's temp dir is on the machine's real disk (not tmpfs), so cold reads of these files
reach the block device and show up in /proc/self/io read_bytes.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from sparkple.builder.build import build_table
from sparkple.builder.plan import plan_build
from sparkple.builder.synth import synth_checkpoint
from sparkple.geometry import PLEGeometry


def direct_rows(path: Path, ids: np.ndarray, width: int) -> np.ndarray:
    """Rows read with plain preads, an independent way to the same bytes: ids.shape + (width,)."""
    ids = np.asarray(ids)
    with open(path, "rb") as f:
        flat = [os.pread(f.fileno(), width, int(i) * width) for i in ids.reshape(-1)]
    return np.frombuffer(b"".join(flat), dtype=np.uint8).reshape(*ids.shape, width)


@dataclass
class BuiltTable:
    snapshot: Path
    table_dir: Path
    geometry: PLEGeometry

    def copy_to(self, dest: Path) -> Path:
        """A private copy of the table directory that a test may damage."""
        shutil.copytree(self.table_dir, dest)
        return dest


@pytest.fixture(scope="session")
def built_table(tmp_path_factory) -> BuiltTable:
    root = tmp_path_factory.mktemp("runtime-table")
    snap = synth_checkpoint(root / "snap", vocab_base=12_000, files=2, seed=3)
    build_table(snap, root / "table", quiet=True)
    return BuiltTable(snap, root / "table", plan_build(snap).geometry)
