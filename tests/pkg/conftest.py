"""Shared fixtures: synthetic snapshots written once per session into pytest's temp dir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkple.builder.synth import synth_checkpoint

ROOT = Path(__file__).resolve().parents[2]  # the checkout


@pytest.fixture(scope="session")
def snapshots(tmp_path_factory):
    """Build (and cache) small synthetic snapshots by name."""
    cache: dict[str, tuple[dict, Path]] = {}

    def get(name: str, **kwargs) -> Path:
        if name not in cache:
            cache[name] = kwargs, synth_checkpoint(tmp_path_factory.mktemp(name) / "snap", **kwargs)
        made_with, path = cache[name]
        assert made_with == kwargs, f"snapshot {name!r} was made with {made_with}, not {kwargs}"
        return path

    return get


def run_cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """`python -m sparkple.cli ARGS` in a real subprocess."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "sparkple.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        **kwargs,
    )


def cli(*args: object) -> subprocess.CompletedProcess:
    """`sparkple ARGS` in this process (fast); same result shape as run_cli."""
    import contextlib
    import io

    from sparkple.cli import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse's usage errors
            rc = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())
