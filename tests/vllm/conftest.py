"""The real vLLM 0.33.0 sources, from the PyPI wheel, cached per machine in `.cache/`.

`vllm_originals` downloads the wheel once (`pip download --no-deps`) and extracts the files the
patch profile touches. `vllm_venv` builds a test virtualenv with the torch and torchvision the
wheel itself pins (its METADATA's `torch==`/`torchvision==`: with a torchvision that matches its
torch, vLLM's ModelConfig can import the model class to inspect its architecture), the wheel
installed `--no-deps`, and only the dependencies its config and the Qwen4Exp PLE modules need
(venv-requirements.txt). PyPI's torch for x86_64 is a CUDA build: about 5.5 GB in the venv and
about 2 minutes to install, the CUDA libraries unused on a CPU-only machine.
Both are created under a lock and marked complete only at the end, so an interrupted run is
redone rather than trusted.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from wheel_cache import CACHE, VLLM_VERSION, extract_once, locked, pip, vllm_wheel

SOURCES_DIR = CACHE / f"vllm-{VLLM_VERSION}-sources"
VENV_DIR = CACHE / "vllm-venv"
HERE = Path(__file__).resolve().parent
# Everything below vllm/ in the wheel that the profile and the integration test read.
EXTRACT_PREFIXES = (
    "vllm/models/qwen4_exp/",
    "vllm/model_executor/model_loader/ep_weight_filter.py",
)
# The wheel's own pins that the venv follows (vision models and ModelConfig's inspection import
# torchvision, which only loads beside the torch it was built for).
PINNED = ("torch", "torchvision")


def wheel_pins(wheel: Path, names: tuple[str, ...] = PINNED) -> list[str]:
    """`name==version` for each of names, as the wheel's METADATA pins them."""
    with zipfile.ZipFile(wheel) as archive:
        (meta,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        text = archive.read(meta).decode()
    pins = {}
    for match in re.finditer(r"^Requires-Dist: ([A-Za-z0-9_.-]+)==([^;\s]+)\s*$", text, re.M):
        pins[match.group(1).lower()] = f"{match.group(1)}=={match.group(2)}"
    missing = [n for n in names if n not in pins]
    if missing:
        raise RuntimeError(f"{wheel.name} pins no exact version of {missing}")
    return [pins[n] for n in names]


@pytest.fixture(scope="session")
def vllm_originals() -> Path:
    """The extracted `vllm` package directory (paths inside it as the profile names them)."""

    def wanted(member: str) -> bool:
        return member.startswith(EXTRACT_PREFIXES) and member.endswith(".py")

    extract_once(vllm_wheel(), SOURCES_DIR, "vllm-sources", wanted, str(EXTRACT_PREFIXES))
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
    pins = wheel_pins(wheel)
    requirements = HERE / "venv-requirements.txt"
    stamp_text = f"{wheel.name}\n{pins}\n{requirements.read_text()}"
    done = VENV_DIR / ".complete"
    with locked("vllm-venv"):
        if not (done.is_file() and done.read_text() == stamp_text):
            shutil.rmtree(VENV_DIR, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(VENV_DIR)], check=True)
            python = _venv_python()
            pip(python, "install", *pins)
            constraints = VENV_DIR / "constraints.txt"
            constraints.write_text("\n".join(pins) + "\n")
            pip(python, "install", "-c", str(constraints), "-r", str(requirements))
            pip(python, "install", "--no-deps", str(wheel))
            done.write_text(stamp_text)
    return _venv_python()
