"""Integration with the real vLLM 0.33.0 package on CPU: stock PLE vs the patched backend."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from sparkple import patching
from sparkple.build import build_table
from sparkple.stats import parse
from sparkple.synth import synth_checkpoint

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "ple_equivalence.py"


def run_equivalence(vllm_venv: Path, vllm_originals: Path, work: Path, device: str) -> dict:
    """Both quantizations in one run of the script (vLLM imports once)."""
    cases = []
    # NVFP4 with a table big enough (86 MiB) that reading it during the load shows in RSS
    for quant, vocab_base in (("nvfp4", 60_000), ("fp8", 300)):
        snapshot = synth_checkpoint(
            work / f"snapshot-{quant}", quant=quant, vocab_base=vocab_base, files=2, seed=7
        )
        table = work / f"table-{quant}"
        build_table(snapshot, table, quiet=True)
        cases.append(f"{snapshot}={table}")
    rendered = work / "rendered"
    patching.render("vllm-0.33", vllm_originals, rendered)
    result_path = work / "result.json"
    # sparkple comes from this checkout, as the serving container's PYTHONPATH mount provides it
    # and the PLE counters go where the service mounts its stats directory
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPARKPLE_STATS_DIR": str(work / "stats")}
    env.pop("VLLM_PLE_PACKED_TABLE_DIR", None)
    args = [str(vllm_venv), str(SCRIPT), device, str(rendered), str(result_path), *cases]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=work)
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = json.loads(result_path.read_text())
    for result in results.values():
        result["rendered"] = str(rendered)
        result["stats_dir"] = str(work / "stats")
    return results


@pytest.fixture(scope="module")
def results(vllm_venv: Path, vllm_originals: Path, tmp_path_factory) -> dict:
    return run_equivalence(vllm_venv, vllm_originals, tmp_path_factory.mktemp("ple-cpu"), "cpu")


@pytest.fixture(scope="module")
def equivalence(results: dict) -> dict:
    return results["nvfp4"]


@pytest.fixture(scope="module")
def equivalence_fp8(results: dict) -> dict:
    return results["fp8"]


def test_stock_path_is_vllms_device_backend(equivalence: dict) -> None:
    assert equivalence["stock_backend"] == "Qwen4ExpPLEDeviceEmbedding"
    # the rows are resident, and loading them read every shard
    assert equivalence["stock_resident_bytes"] >= equivalence["table_bytes"]
    assert equivalence["stock_load_rss_growth"] > equivalence["table_bytes"] // 2


def test_patched_files_select_the_packed_table_backend(equivalence: dict) -> None:
    assert equivalence["patched_module_file"].startswith(equivalence["rendered"])
    assert equivalence["patched_backend"] == "Qwen4ExpPLEPackedTableEmbedding"
    assert equivalence["table_advice"] == "random"


def test_patched_files_without_the_env_var_keep_vllms_backend(equivalence: dict) -> None:
    assert equivalence["patched_unset_backend"] == "Qwen4ExpPLEDeviceEmbedding"


def test_a_missing_table_is_a_clear_error(equivalence: dict) -> None:
    error = equivalence["missing_table_error"]
    assert error is not None and error.startswith("TableError")
    assert "no-table-here" in error


def test_patched_backend_holds_no_shard_data(equivalence: dict) -> None:
    # the table's weight and block scales are shapes only; the global scale and hash buffers load
    assert equivalence["patched_weight_devices"] == ["meta"]
    assert equivalence["patched_resident_bytes"] < 4096
    # The checkpoint's shards pass through load_weights unread. Opening a tensor faults in
    # about one fault-around window (64 KiB) of its file; 256 shard tensors make ~16 MiB,
    # against 86 MiB of rows that the stock load reads.
    assert equivalence["table_bytes"] > 80 * 2**20
    assert equivalence["patched_load_rss_growth"] < 20 * 2**20
    assert "ngram_embedding.weight" in equivalence["patched_loaded"]
    assert "ngram_embedding.weight_scale" in equivalence["patched_loaded"]
    assert "ngram_embedding.weight_scale_2" in equivalence["patched_loaded"]
    assert equivalence["global_scale_loaded"] == equivalence["global_scale_table"]
    assert equivalence["buffers_equal"]


def test_patched_outputs_equal_stock_in_the_model_dtype(equivalence: dict) -> None:
    assert equivalence["bfloat16_steps"] == 6
    assert equivalence["bfloat16_shapes_equal"] and equivalence["bfloat16_nonzero"]
    assert all(equivalence["bfloat16_identical"]), equivalence["bfloat16_max_abs_diff"]


def test_patched_float32_outputs_equal_vllms_kernel_arithmetic(equivalence: dict) -> None:
    # vLLM's CPU and CUDA paths multiply the three NVFP4 factors in different orders;
    # sparkple follows the CUDA kernel bit for bit and the CPU path to one rounding.
    assert equivalence["float32_steps"] == 6
    assert equivalence["float32_shapes_equal"] and equivalence["float32_nonzero"]
    assert all(equivalence["float32_identical_to_kernel_order"])
    assert equivalence["float32_max_rel_diff_to_cpu_path"] <= 2.0**-23


def test_fp8_table_equals_stock(equivalence_fp8: dict) -> None:
    # FP8 rows leave the backend as FP8, like vLLM's lookup; the PLE layer applies the scale
    result = equivalence_fp8
    assert result["quant"] == "fp8"
    assert result["patched_backend"] == "Qwen4ExpPLEPackedTableEmbedding"
    assert result["patched_weight_devices"] == ["meta"]
    assert "ngram_embedding.weight" in result["patched_loaded"]
    assert result["global_scale_loaded"] == result["global_scale_table"]
    for dtype in ("float32", "bfloat16"):
        assert result[f"{dtype}_nonzero"]
        assert all(result[f"{dtype}_identical"]), result[f"{dtype}_max_abs_diff"]
    assert result["chunked_equals_whole"]


def test_patched_backend_exports_its_ple_counters(equivalence: dict) -> None:
    written = sorted(Path(equivalence["stats_dir"]).glob("ple-stats-*.json"))
    assert len(written) == 1, written  # one serving process, one file
    snapshot = parse(written[0].read_text())
    assert snapshot["counters"]["rows_gathered"] > 0
    assert snapshot["counters"]["gather_calls"] > 0
    assert snapshot["handshake_wait_seconds"]["count"] == snapshot["counters"]["gather_calls"]


def test_chunked_prefill_and_decode_equal_one_pass(equivalence: dict) -> None:
    assert equivalence["chunked_equals_whole"]


def test_sparkple_row_ids_equal_vllm_compute_ngram_ids(equivalence: dict) -> None:
    assert equivalence["ngram_trials"] == 50
    assert equivalence["ngram_mismatched"] == 0


@pytest.mark.gpu
def test_cuda_path_equals_vllms_triton_kernel(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Pinned staging, the device copy and the NVFP4 decode on the GPU vs vLLM's own kernel."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    vllm_venv = request.getfixturevalue("vllm_venv")
    vllm_originals = request.getfixturevalue("vllm_originals")
    probe = [str(vllm_venv), "-c", "import torch, triton; print(torch.cuda.is_available())"]
    seen = subprocess.run(probe, capture_output=True, text=True).stdout.strip()
    if seen != "True":
        pytest.skip("the vLLM test venv has no CUDA torch with triton")
    for result in run_equivalence(vllm_venv, vllm_originals, tmp_path, "cuda").values():
        assert result["device"] == "cuda"
        assert result["patched_backend"] == "Qwen4ExpPLEPackedTableEmbedding"
        assert result["patched_weight_devices"] == ["meta"]
        assert result["ngram_mismatched"] == 0  # vLLM's Triton hash on CUDA
        # on CUDA the stock path is vLLM's Triton lookup kernel itself
        assert all(result["float32_identical"]), result["float32_max_abs_diff"]
        assert all(result["bfloat16_identical"]), result["bfloat16_max_abs_diff"]
        assert result["chunked_equals_whole"]
