"""sparkple.measure.gpuclock: nvidia-smi's answer parsed, a missing nvidia-smi reported as no
clock, and the clock-difference rule, with a real executable standing in for nvidia-smi."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sparkple.measure import gpuclock


def test_parse_reads_the_first_gpus_current_and_max_clock() -> None:
    assert gpuclock.parse("2405, 3003\n1200, 3003\n") == (2405, 3003)
    assert gpuclock.parse("[N/A], [N/A]\n") is None
    assert gpuclock.parse("") is None


def test_sm_clock_runs_nvidia_smi_and_none_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "nvidia-smi"
    query = "--query-gpu=clocks.sm,clocks.max.sm"
    fake.write_text(f'#!/bin/sh\n[ "$1" = {query} ] && echo "611, 3003"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert gpuclock.sm_clock() == (611, 3003)
    assert gpuclock.sm_clock("no-such-nvidia-smi") is None


def test_differ_compares_against_the_higher_clock_and_ignores_unknown_ones() -> None:
    assert gpuclock.differ(600, 3003, 0.10)
    assert not gpuclock.differ(2900, 3003, 0.10)
    assert not gpuclock.differ(None, 3003, 0.10)
