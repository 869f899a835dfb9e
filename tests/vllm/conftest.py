"""The real vLLM 0.33.0 sources, from the PyPI wheel, cached per machine (harness/wheel_cache.py).

`vllm_originals` extracts the files the patch profile touches from the wheel (downloaded once,
`pip download --no-deps`). `vllm_venv` is the test virtualenv with the torch and torchvision the
wheel itself pins (its METADATA's `torch==`/`torchvision==`: with a torchvision that matches its
torch, vLLM's ModelConfig can import the model class to inspect its architecture), the wheel
installed `--no-deps`, and only the dependencies its config and the Qwen4Exp PLE modules need
(venv-requirements.txt). Both are built under a lock and marked complete only at the end, so an
interrupted run is redone rather than trusted.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import wheel_cache


@pytest.fixture(scope="session")
def vllm_originals() -> Path:
    """The extracted `vllm` package directory (paths inside it as the profile names them);
    SPARKPLE_VLLM_SOURCES names others (the GPU check's, offline)."""
    sources = wheel_cache.given_sources()
    return sources / "vllm" if sources else wheel_cache.vllm_originals()


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """Python of a venv with vLLM 0.33.0 (no deps) that imports the Qwen4Exp PLE modules.

    SPARKPLE_VLLM_PYTHON names another interpreter with vLLM 0.33.0 instead, e.g. one with
    CUDA torch and triton, where the `gpu` test can run.
    """
    override = os.environ.get("SPARKPLE_VLLM_PYTHON")
    if override:
        return Path(override)
    return wheel_cache.vllm_venv()
