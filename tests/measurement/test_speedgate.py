"""The rollout's speed gate (sparkple/measure/speedgate.py): its figures from a real lab server
whose engine takes a fixed time per token, and its verdict, through the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from lab_inputs import ROOT, lab_server

from sparkple.builder.build import build_table
from sparkple.builder.synth import synth_checkpoint
from sparkple.errors import SparkpleError
from sparkple.measure import speedgate

MODEL = "qwen3.8-flash-next"
DELAY_S = 0.04  # the lab engine's time per token: at most 25 tok/s per stream


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("speed-lab")
    snap = synth_checkpoint(root / "snap", vocab_base=2048, files=1, seed=5)
    build_table(snap, root / "table", quiet=True)
    args = [f"--served-model-name={MODEL}", "--max-num-seqs=4"]
    with lab_server(
        root, snap, root / "table", args, {"SPARKPLE_LAB_TOKEN_DELAY_S": str(DELAY_S)}
    ) as port:
        yield f"http://127.0.0.1:{port}"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "sparkple.cli", "speed-gate", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)


def figures(tok_s: dict[str, float], max_tokens: int = 8) -> dict[str, object]:
    streams = [int(n) for n in tok_s]
    return {"tok_s": tok_s, "settings": speedgate.settings(streams, 1, max_tokens)}


def test_a_release_at_half_the_speed_fails_the_gate_naming_both_figures(
    slow_server: str, tmp_path: Path
) -> None:
    """The slow server's figures come from its real replies; no run can beat its engine's time
    per token (each stream makes at most 1/DELAY_S tok/s), so against a release twice as fast as
    that bound the ratio is at most 0.5, whatever the machine's load."""
    new = tmp_path / "new.json"
    measured = cli("measure", "--url", slow_server, "--model", MODEL, "--streams", "1", "4",
                   "--requests", "1", "--max-tokens", "8", "--release", "bprime",
                   "--out", str(new))  # fmt: skip
    assert measured.returncode == 0, measured.stderr
    got = json.loads(new.read_text())
    assert got["release"] == "bprime" and set(got["tok_s"]) == {"1", "4"}
    for streams, value in got["tok_s"].items():
        assert 0 < value <= int(streams) / DELAY_S
    old = tmp_path / "old.json"
    old.write_text(json.dumps(figures({"1": 2 / DELAY_S, "4": 8 / DELAY_S})))
    keep = tmp_path / "speed.json"
    checked = cli("check", "--new", str(new), "--old", str(old), "--host", "spark-2",
                  "--keep", str(keep))  # fmt: skip
    assert checked.returncode == 1, checked.stderr
    line, each, warmup, clock = checked.stdout.splitlines()
    assert line.startswith("speed gate: spark-2 ") and line.endswith(" < 0.9)")
    # the conditions of both figures: the new one's measured here (the lab has no GPU clock)
    assert warmup.startswith("speed gate: spark-2 warm-up: new ")
    assert warmup.endswith("; old no warm-up recorded")
    assert clock == (
        "speed gate: spark-2 GPU clock: new none reported (no nvidia-smi); "
        "old none reported (no nvidia-smi)"
    )
    assert float(line.split("(ratio ")[1].split()[0]) <= 0.5
    assert "1 stream " in each and "4 streams " in each
    assert not keep.exists()  # a failed release's figures are no baseline

    # against its own figures it passes, and they are kept for the next rollout
    passed = cli("check", "--new", str(new), "--old", str(new), "--host", "spark-2",
                 "--keep", str(keep))  # fmt: skip
    assert passed.returncode == 0 and "(ratio 1.00 >= 0.9)" in passed.stdout
    assert json.loads(keep.read_text()) == got


def test_kept_figures_of_the_same_settings_are_reused_and_others_measured_again(
    slow_server: str, tmp_path: Path
) -> None:
    out = tmp_path / "speed.json"
    kept = {**figures({"1": 1.0}), "release": "a"}
    out.write_text(json.dumps(kept))
    common = ["--url", slow_server, "--model", MODEL, "--streams", "1", "--requests", "1",
              "--out", str(out), "--reuse"]  # fmt: skip
    reused = cli("measure", *common, "--max-tokens", "8")
    assert reused.returncode == 0 and reused.stdout.startswith("kept: ")
    assert json.loads(out.read_text()) == kept
    measured = cli("measure", *common, "--max-tokens", "4")  # other settings: measured again
    assert measured.returncode == 0, measured.stderr
    assert json.loads(out.read_text())["settings"]["max_tokens"] == 4


def test_a_release_as_fast_as_the_one_before_passes() -> None:
    passed, line = speedgate.verdict("duo-head", figures({"1": 6.5, "8": 50.0}),
                                     figures({"1": 6.6, "8": 51.0}), 0.9)  # fmt: skip
    assert passed
    assert line.startswith("speed gate: duo-head 50.0 tok/s vs 51.0 tok/s (ratio 0.98 >= 0.9)\n")


def test_the_lowest_ratio_over_the_stream_counts_decides() -> None:
    passed, line = speedgate.verdict("spark-1", figures({"1": 10.0, "8": 40.0}),
                                     figures({"1": 10.0, "8": 80.0}), 0.9)  # fmt: skip
    assert not passed
    assert line.startswith("speed gate: spark-1 40.0 tok/s vs 80.0 tok/s (ratio 0.50 < 0.9)\n")


def test_figures_of_other_settings_are_not_compared() -> None:
    with pytest.raises(SparkpleError, match="other settings"):
        speedgate.verdict("spark-1", figures({"1": 10.0}, 16), figures({"1": 10.0}, 8), 0.9)
    with pytest.raises(SparkpleError, match="no number of streams"):  # a file edited by hand
        empty = {**figures({"1": 1.0}), "tok_s": {}}
        speedgate.verdict("spark-1", figures({"1": 10.0}), empty, 0.9)


def test_a_measurement_past_its_time_bound_fails(slow_server: str) -> None:
    with pytest.raises(SparkpleError):
        speedgate.measure(slow_server, MODEL, "", [1], requests=4, max_tokens=64, timeout_s=0.5)


def test_a_server_that_refuses_fails_with_its_address(tmp_path: Path) -> None:
    out = tmp_path / "f.json"
    result = cli("measure", "--url", "http://127.0.0.1:9", "--model", MODEL, "--out", str(out))
    assert result.returncode == 1
    assert "http://127.0.0.1:9" in result.stderr and not out.exists()


def test_with_no_figures_of_the_release_before_the_new_ones_are_kept_not_compared(
    tmp_path: Path,
) -> None:
    """The current release could not be measured (down): nothing holds the new one back."""
    new, keep = tmp_path / "new.json", tmp_path / "speed.json"
    new.write_text(json.dumps(figures({"1": 5.0})))
    result = cli("check", "--new", str(new), "--old", str(tmp_path / "none.json"),
                 "--host", "spark-1", "--keep", str(keep))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("speed gate: spark-1: no figures of the release before")
    assert json.loads(keep.read_text()) == json.loads(new.read_text())
