"""Fixtures for the operations tests."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ops_helpers import Standin
from standin import free_port


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[Standin]:
    server = Standin(tmp_path / "service", free_port())
    server.dir.mkdir()
    yield server
    server.kill_all()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Callable[[list[str]], subprocess.Popen]]:
    """Start long-running programs, output into <tmp>/proc-N.log (read it with `output(p)`);
    every one is terminated at teardown."""
    started: list[subprocess.Popen] = []

    def spawn(argv: list[str]) -> subprocess.Popen:
        log = tmp_path / f"proc-{len(started)}.log"
        with open(log, "wb") as out:
            p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        p.log_path = log  # type: ignore[attr-defined]
        started.append(p)
        return p

    yield spawn
    for p in started:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
