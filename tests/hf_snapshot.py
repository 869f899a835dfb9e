"""A synthetic checkpoint published as the HF cache lays one out (`blobs/` and relative symlinks
in `snapshots/<rev>/`), with the role's own publisher (roles/model_checkpoint/files/)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from sparkple.builder.synth import synth_checkpoint

REPO = Path(__file__).resolve().parents[1]
REPO_DIR = "models--Mia-AiLab--Qwen3.8-Flash-Next-NVFP4"


def load_layout():
    """roles/model_checkpoint/files/hf_cache_layout.py, the file the role copies to a host."""
    path = REPO / "roles/model_checkpoint/files/hf_cache_layout.py"
    spec = importlib.util.spec_from_file_location("hf_cache_layout", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_cache_snapshot(root: Path, *, files: int, seed: int, rev: str = "rev") -> Path:
    """Synthesize a small checkpoint under root's repository directory and publish it; returns
    the snapshot directory (`<root>/models--.../snapshots/<rev>`)."""
    repo = root / REPO_DIR
    (repo / "snapshots").mkdir(parents=True)
    partial = repo / "snapshots" / f"{rev}.partial"
    synth_checkpoint(partial, vocab_base=2048, files=files, seed=seed)
    load_layout().publish(partial, repo, rev)
    return repo / "snapshots" / rev
