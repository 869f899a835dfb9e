"""The vLLM 0.33.0 wheel from PyPI, downloaded once per machine into the git-ignored `.cache/`.

Shared by the tests that read vLLM's own code (tests/pkg cross-checks, tests/vllm patches and
integration), so there is one download, under one lock.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache"
VLLM_VERSION = "0.33.0"
WHEEL_DIR = CACHE / "vllm-wheel"


@contextmanager
def locked(name: str) -> Iterator[None]:
    CACHE.mkdir(exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def pip(python: Path | str, *args: str) -> None:
    cmd = [str(python), "-m", "pip", "--disable-pip-version-check", "-q", *args]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}")


def vllm_wheel() -> Path:
    with locked("vllm-wheel"):
        # any folder of .cache/ that already holds the wheel (other tests fetch it too)
        wheels = sorted(CACHE.glob(f"*/vllm-{VLLM_VERSION}-*.whl"))
        if not wheels:
            pip(
                sys.executable,
                "download",
                "--no-deps",
                f"vllm=={VLLM_VERSION}",
                "-d",
                str(WHEEL_DIR),
            )
            wheels = sorted(WHEEL_DIR.glob(f"vllm-{VLLM_VERSION}-*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download left no vllm {VLLM_VERSION} wheel in {WHEEL_DIR}")
        return wheels[0]
