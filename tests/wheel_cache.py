"""The vLLM 0.33.0 wheel from PyPI, downloaded once per machine into the git-ignored `.cache/`.

Shared by the tests that read vLLM's own code (tests/pkg cross-checks, tests/vllm patches and
integration), so there is one download, under one lock.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
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


def extract_once(
    wheel: Path, dest: Path, lock: str, wanted: Callable[[str], bool], recipe: str
) -> Path:
    """The wheel's members that `wanted` accepts, extracted into dest under `lock` and marked
    complete at the end (with the wheel's name and `recipe`, which says what was selected), so
    an interrupted or differently selected extraction is redone rather than trusted."""
    done = dest / ".complete"
    stamp = f"{wheel.name}\n{recipe}\n"
    with locked(lock):
        if not (done.is_file() and done.read_text() == stamp):
            shutil.rmtree(dest, ignore_errors=True)
            with zipfile.ZipFile(wheel) as archive:
                for member in archive.namelist():
                    if wanted(member):
                        archive.extract(member, dest)
            done.write_text(stamp)
    return dest
