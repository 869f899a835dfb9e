"""The CUDA-graph check: its CPU smoke mode here, the whole check where a GPU is."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from sparkple import patch
from sparkple.build import build_table
from sparkple.synth import synth_checkpoint

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "gpu_graph_check.py"
SHAPES = ("1", "8", "16", "2048")
MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE", "NONE")


def run_graph_check(vllm_venv: Path, vllm_originals: Path, work: Path, device: str, vocab: int):
    snapshot = synth_checkpoint(work / "snapshot", quant="nvfp4", vocab_base=vocab, files=2)
    table = work / "table"
    build_table(snapshot, table, quiet=True)
    rendered = work / "rendered"
    patch.render("vllm-0.33", vllm_originals, rendered)
    out = work / "graph.json"
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{SCRIPT.parent}"}
    env.pop("SPARKPLE_PLE_TABLE_DIR", None)
    args = [str(vllm_venv), str(SCRIPT), device, str(rendered), str(out), f"{snapshot}={table}"]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=work)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return json.loads(out.read_text()), proc.stdout


def assert_honest_checks(result: dict) -> None:
    checks = result["checks"]
    assert len(checks["replays"]) == 6
    for replay in checks["replays"]:
        assert replay == {
            "equals_stock": True,
            "nonzero": True,
            "padding_zero": True,
            "differs_from_previous": True,
        }
    assert checks["zero_rows_replay_zero"]
    assert checks["sizes"] == {"1": True, "8": True, "16": True}
    assert result["ok"] and result["failed"] == []


def assert_timed_shapes(result: dict, executions: dict[str, set[str]]) -> None:
    host_side = result["host_side"]
    assert tuple(host_side) == SHAPES
    for tokens, shape in host_side.items():
        assert set(shape["by_execution"]) == executions[tokens]
        for temps in shape["by_execution"].values():
            for figures in (temps["cold"], temps["warm"]):
                assert 0 < figures["host_side_ms"] <= figures["step_ms"]
                assert figures["gather_wait_ms"] >= 0
        assert tuple(shape["modes"]) == MODES
    # what vLLM 0.33 runs for one layer: FULL graphs for uniform decode, piecewise graphs
    # (the same capture for one layer) for mixed steps, eager beyond the largest capture size
    assert host_side["16"]["modes"] == {
        "FULL_AND_PIECEWISE": "full",
        "FULL_DECODE_ONLY": "full",
        "PIECEWISE": "piecewise",
        "NONE": "eager",
    }
    assert set(host_side["2048"]["modes"].values()) == {"eager"}


def test_graph_check_smoke_mode_builds_and_checks_everything_up_to_cuda(
    vllm_venv: Path, vllm_originals: Path, tmp_path: Path
) -> None:
    """The smoke mode builds the check's vLLM config (the Engram config a Qwen4Exp server
    resolves, validated by VllmConfig), both layers, vLLM's model state and dummy inputs,
    then runs the same steps eagerly: a crash before the first CUDA call fails here."""
    result, stdout = run_graph_check(vllm_venv, vllm_originals, tmp_path, "cpu", vocab=3000)
    assert "cpu_offload=True" in result["engram_config"]
    assert result["stock_backend"] == "Qwen4ExpPLEDeviceEmbedding"
    assert result["patched_backend"] == "Qwen4ExpPLEPackedTableEmbedding"
    assert_honest_checks(result)
    assert_timed_shapes(
        result,
        {
            "1": {"eager", "graph"},
            "8": {"eager", "graph"},
            "16": {"eager", "graph"},
            "2048": {"eager"},
        },
    )
    assert stdout.splitlines() == result["summary"]
    assert "all checks passed" in stdout.splitlines()[0]


@pytest.mark.gpu
def test_graph_check_on_cuda(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The same check with FULL CUDA graphs against stock vLLM's pinned-host lookup."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    vllm_venv = request.getfixturevalue("vllm_venv")
    vllm_originals = request.getfixturevalue("vllm_originals")
    result, _ = run_graph_check(vllm_venv, vllm_originals, tmp_path, "cuda", vocab=60_000)
    assert result["stock_backend"] == "Qwen4ExpPLEPinnedHostEmbedding"
    assert result["patched_backend"] == "Qwen4ExpPLEPackedTableEmbedding"
    assert result["staging_pinned"] and result["host_inputs_pinned"]
    assert_honest_checks(result)
    assert_timed_shapes(
        result,
        {
            "1": {"eager", "graph"},
            "8": {"eager", "graph"},
            "16": {"eager", "graph"},
            "2048": {"eager"},
        },
    )
