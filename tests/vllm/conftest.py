"""The real vLLM 0.33.0 sources, from the PyPI wheel, cached per machine in `.cache/`.

`vllm_originals` downloads the wheel once (`pip download --no-deps`) and extracts the files the
patch profile touches. `vllm_venv` builds a test virtualenv with CPU torch 2.13, the wheel
installed `--no-deps`, and only the dependencies importing the Qwen4Exp PLE modules needs.
Both are created under a lock and marked complete only at the end, so an interrupted run is
redone rather than trusted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from wheel_cache import CACHE, VLLM_VERSION, locked, pip, vllm_wheel

SOURCES_DIR = CACHE / f"vllm-{VLLM_VERSION}-sources"
VENV_DIR = CACHE / "vllm-venv"
HERE = Path(__file__).resolve().parent
# Everything below vllm/ in the wheel that the profile and the integration test read.
EXTRACT_PREFIXES = (
    "vllm/models/qwen4_exp/",
    "vllm/model_executor/model_loader/ep_weight_filter.py",
)
# torch 2.13.0 (CPU) is a local file pip finds; vLLM's own pin (2.14) would download GBs.
TORCH_PIN = "torch==2.13.0"


@pytest.fixture(scope="session")
def vllm_originals() -> Path:
    """The extracted `vllm` package directory (paths inside it as the profile names them)."""
    wheel = vllm_wheel()
    done = SOURCES_DIR / ".complete"
    stamp = f"{wheel.name}\n{EXTRACT_PREFIXES}\n"
    with locked("vllm-sources"):
        if not (done.is_file() and done.read_text() == stamp):
            shutil.rmtree(SOURCES_DIR, ignore_errors=True)
            with zipfile.ZipFile(wheel) as archive:
                for member in archive.namelist():
                    if member.startswith(EXTRACT_PREFIXES) and member.endswith(".py"):
                        archive.extract(member, SOURCES_DIR)
            done.write_text(stamp)
    return SOURCES_DIR / "vllm"


def _venv_python() -> Path:
    return VENV_DIR / "bin" / "python"


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """Python of a venv with vLLM 0.33.0 (no deps) that imports the Qwen4Exp PLE modules.

    SPARKPLE_VLLM_PYTHON names another interpreter with vLLM 0.33.0 instead, e.g. one with
    CUDA torch and triton, where the `gpu` test can run.
    """
    override = os.environ.get("SPARKPLE_VLLM_PYTHON")
    if override:
        return Path(override)
    wheel = vllm_wheel()
    requirements = HERE / "venv-requirements.txt"
    stamp_text = f"{wheel.name}\n{TORCH_PIN}\n{requirements.read_text()}"
    done = VENV_DIR / ".complete"
    with locked("vllm-venv"):
        if not (done.is_file() and done.read_text() == stamp_text):
            shutil.rmtree(VENV_DIR, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(VENV_DIR)], check=True)
            python = _venv_python()
            pip(python, "install", TORCH_PIN)
            constraints = VENV_DIR / "constraints.txt"
            constraints.write_text(TORCH_PIN + "\n")
            pip(python, "install", "-c", str(constraints), "-r", str(requirements))
            pip(python, "install", "--no-deps", str(wheel))
            done.write_text(stamp_text)
    return _venv_python()
