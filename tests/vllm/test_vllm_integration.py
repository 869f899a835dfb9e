"""Integration with the real vLLM packages on CPU, each release a profile names (0.34.0, the
default, and 0.33.0) against its own profile: stock PLE vs the patched backend."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from skip_guard import skip_without_cuda

from harness import wheel_cache
from sparkple import patch
from sparkple.builder.build import build_table
from sparkple.builder.synth import synth_checkpoint
from sparkple.runtime.stats import parse

from .conftest import Release

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "harness" / "ple_equivalence.py"
LOOKAHEAD_MIB = 2


def run_equivalence(
    vllm_venv: Path, vllm_originals: Path, work: Path, device: str, profile: str
) -> dict:
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
    # a 2 MiB lookahead window (512 pages): the test's long prompts span many windows
    patch.render(profile, vllm_originals, rendered, {"lookahead_mib": str(LOOKAHEAD_MIB)})
    result_path = work / "result.json"
    # sparkple comes from this checkout, as the serving container's PYTHONPATH mount provides it
    # and the PLE counters go where the service mounts its stats directory
    env = {
        **os.environ,
        "PYTHONPATH": wheel_cache.pythonpath(REPO),
        "SPARKPLE_STATS_DIR": str(work / "stats"),
    }
    env.pop("SPARKPLE_PLE_TABLE_DIR", None)
    args = [str(vllm_venv), str(SCRIPT), device, str(rendered), str(result_path), *cases]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=work)
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = json.loads(result_path.read_text())
    for quant in ("nvfp4", "fp8"):
        result = results[quant]
        result["rendered"] = str(rendered)
        result["stats_dir"] = str(work / "stats")
    return results


@pytest.fixture(scope="module")
def results(release: Release, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp(f"ple-cpu-{release.version}")
    return run_equivalence(release.python, release.originals, work, "cpu", release.profile)


@pytest.fixture(scope="module")
def equivalence(results: dict) -> dict:
    return results["nvfp4"]


@pytest.fixture(scope="module")
def equivalence_fp8(results: dict) -> dict:
    return results["fp8"]


def test_each_release_is_compared_with_its_own_backends(release: Release, results: dict) -> None:
    """0.34 brings its own disk offload, a second reference; 0.33 has none."""
    for quant in ("nvfp4", "fp8"):
        assert results[quant]["disk_offload"] == (release.version != "0.33.0")


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
    # what it does hold: one step's packed rows (max tokens x 16 heads x 90 B) and the decode
    # tables (256 x 2 + 256 float32)
    assert equivalence["patched_step_buffer_bytes"] == 512 * 16 * 90 + (512 + 256) * 4
    assert "ngram_embedding.weight" in equivalence["patched_loaded"]
    assert "ngram_embedding.weight_scale" in equivalence["patched_loaded"]
    assert "ngram_embedding.weight_scale_2" in equivalence["patched_loaded"]
    assert equivalence["global_scale_loaded"] == equivalence["global_scale_table"]
    assert equivalence["buffers_equal"]


def test_vllms_loader_reads_no_row_shard(equivalence: dict, equivalence_fp8: dict) -> None:
    """vLLM's own safetensors iterator (lazy strategy) with the patched loader filter: the row
    shards are skipped by name before they are read, whatever safetensors would do with them."""
    for result, shard_tensors in ((equivalence, 256), (equivalence_fp8, 128)):
        # stock, and the patched files without a table, read every shard tensor
        assert result["stock_shard_tensors_read"] == shard_tensors
        assert result["patched_unset_shard_tensors_read"] == shard_tensors
        assert result["patched_shard_tensors_read"] == 0
        scale = "weight_scale_2" if result["quant"] == "nvfp4" else "weight_scale"
        assert result["patched_tensors_read"] == sorted(
            [
                "layer_multipliers",
                "ngram_heads_offsets",
                "ngram_heads_vocab_sizes",
                f"ngram_embedding.{scale}",
            ]
        )
    # 86 MiB of rows: the stock load grows RSS by more than the table, the patched one by less
    # than a few pages
    assert equivalence["table_bytes"] > 80 * 2**20
    assert equivalence["stock_load_rss_growth"] > equivalence["table_bytes"] // 2
    assert equivalence["patched_load_rss_growth"] < 1 * 2**20


def test_host_buffers_stay_on_the_cpu_in_another_device_context(equivalence: dict) -> None:
    # built inside `with torch.device("meta")`, as vLLM builds models inside its device's context
    assert equivalence["meta_device_buffers"] == ["meta"]
    assert equivalence["meta_host_buffers"] == ["cpu"]


def test_in_forward_path_compiles_as_one_graph(equivalence: dict, equivalence_fp8: dict) -> None:
    # torch.compile(fullgraph=True) raises on any graph break or host synchronization: what
    # the forward runs of the backend is device work a CUDA graph can capture, for a
    # prefill-shaped and a decode-shaped step, both dtypes
    for result in (equivalence, equivalence_fp8):
        assert result["compiled_steps"] == {
            "mixed prefill": [True, True],
            "uniform decode": [True, True],
        }


def test_steps_through_vllms_model_state_equal_stock(equivalence: dict) -> None:
    """Every step built by vLLM's Qwen4ExpModelState.prepare_inputs, with the host step it runs:
    chunked prefill, decode, padding, draft verification and a rejection."""
    assert equivalence["step_names"][:11] == STEP_NAMES
    for dtype in ("float32", "bfloat16"):
        assert equivalence[f"{dtype}_steps"] == 57
        assert equivalence[f"{dtype}_nonzero"]
        # bit-identical to the arithmetic of vLLM's Triton lookup kernel, in both dtypes
        assert all(equivalence[f"{dtype}_identical_to_kernel_order"])
        # rows of CUDA-graph padding tokens are zeros (stock computes rows for them too)
        assert equivalence[f"{dtype}_padding_rows_zero"]
        assert equivalence[f"{dtype}_chunked_equals_whole"]
    # vLLM 0.34's own disk offload (its host half, the CPU's share of it) stages the same rows
    # at every step: the packed table gives what it gives, bit for bit
    if equivalence["disk_offload"]:
        for dtype in ("float32", "bfloat16"):
            assert equivalence[f"{dtype}_disk_nonzero"]
            assert all(equivalence[f"{dtype}_disk_equals_stock"])
            assert all(equivalence[f"{dtype}_disk_identical"])
    # vLLM's CPU path multiplies the two scales first: one float32 rounding apart at most,
    # and (on this data) equal once rounded to bfloat16
    assert equivalence["float32_max_rel_diff"] <= 2.0**-23
    assert equivalence["bfloat16_max_rel_diff"] <= 2.0**-8


STEP_NAMES = [
    "mixed prefill",
    "chunk and decode",
    "uniform decode",
    "verify drafts",
    "after rejection",
    "prompt, decode and drafts",
    "after a removed prompt",
    "re-added prompt",
    "prompt tail and decode",
    "long prompt decodes",
    "whole",
]


def test_prompt_only_steps_never_wait_for_the_device(equivalence: dict) -> None:
    """The rows of prompt tokens come from the prompts the model state keeps: a step of
    prompt tokens alone copies nothing from the device and waits for nothing; a step with a
    decode token or MTP drafts waits once, for those."""
    synced = dict(zip(equivalence["step_names"], equivalence["synced_steps"], strict=False))
    by_step = equivalence["synced_steps"]
    assert not by_step[0]  # mixed prefill: three prompt chunks
    assert not by_step[10]  # a whole 300-token prompt
    assert by_step[11:13] == [False, False]  # its two 128-token chunks
    assert all(by_step[13:])  # then one decode token a step
    for name in STEP_NAMES[1:10]:  # every step with decode tokens or drafts
        assert synced[name], name


def test_lookahead_advises_later_chunks_within_its_window(equivalence: dict) -> None:
    """Prompts longer than the window are advised granule by granule as their chunks run;
    the removed prompt's advice that no step reached is counted as wasted."""
    look = equivalence["lookahead"]
    assert look["window_pages"] == LOOKAHEAD_MIB * 2**20 // 4096
    assert 0 < look["peak_pages"] <= look["window_pages"]
    assert look["advised"] > look["window_pages"]  # the window moved on, more than once
    assert look["used"] > 0 and look["wasted"] > 0
    assert look["used"] + look["wasted"] <= look["advised"]
    # the removed request's prompt is gone; the others stay until vLLM removes them
    assert look["prompts_held"] == sorted(["r0", "r1", "r2", "r3", "r4", "r5", "whole", "chunked"])


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
        if result["disk_offload"]:  # vLLM 0.34's own disk offload: the same rows, bit for bit
            assert result[f"{dtype}_disk_nonzero"]
            assert all(result[f"{dtype}_disk_identical"])
            assert all(result[f"{dtype}_disk_equals_stock"])
        assert result[f"{dtype}_padding_rows_zero"]
        assert result[f"{dtype}_chunked_equals_whole"]


def test_dummy_and_capture_runs_read_no_rows(equivalence: dict) -> None:
    # prepare_dummy_inputs (graph capture) and a dummy batch through prepare_inputs (profile,
    # warm-up, DP idle): zeros in the device buffer, no row gathered, no handshake wait
    assert equivalence["dummy_outputs_zero"] == [True, True]
    before, after = equivalence["dummy_counters_before_after"]
    assert before == after
    assert before[0] > 0  # the real steps did gather


def test_unservable_settings_are_refused_by_name(results: dict) -> None:
    refusals = results["refusals"]
    assert "--pipeline-parallel-size 2" in refusals["pipeline"]
    assert "--prefill-context-parallel-size 2" in refusals["prefill_context_parallel"]
    # what one release refuses alone (sparkple/vllm/releases.py): 0.33's V1 runner, 0.34's own
    # disk offload beside the packed table
    if "v1_runner" in refusals:
        assert "VLLM_USE_V2_MODEL_RUNNER=0" in refusals["v1_runner"]
    else:
        assert "disk_offload" in refusals["disk_offload"]
        assert "drop disk_offload" in refusals["disk_offload"]
    # tensor parallelism: a pair is served, larger groups and other PLE splits are not
    assert "--tensor-parallel-size 4" in refusals["tensor_parallel_4"]
    assert "--enable-hc-sp" in refusals["sequence_parallel"]
    assert "--tensor-parallel-size" not in refusals["sequence_parallel"]  # 2 itself is served
    assert "embedding_across_dp=true" in refusals["embedding_across_dp"]
    for message in refusals.values():
        assert "unset SPARKPLE_PLE_TABLE_DIR" in message


def test_gather_failures_end_the_step_with_an_exception(results: dict) -> None:
    failures = results["failures"]
    assert failures["io_error"]["error"] == "OSError: [Errno 5] Input/output error"
    assert failures["io_error"]["seconds"] < 5
    assert failures["timeout"]["error"].startswith("HandshakeTimeout")
    assert 0.2 <= failures["timeout"]["seconds"] < 1.5
    assert failures["dead_thread"]["error"].startswith("ProducerDied")
    assert failures["dead_thread"]["seconds"] < 1.0


def test_host_prompt_tokens_are_checked_against_the_devices(results: dict) -> None:
    """A host whose computed-prefill count of a prompt is 1 or 4 tokens off: the first step
    that waits for the device anyway (a decode beside the prompt chunk) brings back the last
    prompt token of the chunk with its own copy, finds it differs, counts it, and takes that
    step's rows from the device's inputs; from then on the request's rows all come from the
    device (a prompt-only step of it waits too). Every step's rows are right. Without the
    probes, the same fault gives wrong rows and no error."""
    checks = results["host_checks"]
    for by in (1, 4):
        shifted = checks[f"shifted_{by}"]
        assert shifted["rows_right"] == [True, True, True, True], by
        assert shifted["synced"] == [False, True, True, True], by
        assert shifted["mismatches"] == [0, 1, 1, 1], by  # counted once, for the one request
    unprobed = checks["unprobed"]
    assert unprobed["rows_right"] == [True, False, False, False]
    assert unprobed["synced"] == [False, True, True, False]
    assert unprobed["mismatches"] == [0, 0, 0, 0]


def test_moved_request_boundaries_take_every_row_from_the_device(results: dict) -> None:
    """The device verifies fewer of a request's drafts than the host scheduled: the boundaries
    the step copies differ from the host's, and every row comes from the device's inputs (no
    mismatch is counted: the host's prompt view was right); the next step is split again."""
    moved = results["host_checks"]["moved"]
    assert moved["rows_right"] == [True, True, True, True]
    assert moved["synced"] == [False, True, True, True]
    assert moved["mismatches"] == [0, 0, 0, 0]


def test_patched_backend_exports_its_ple_counters(equivalence: dict) -> None:
    written = sorted(Path(equivalence["stats_dir"]).glob("ple-stats-*.json"))
    assert len(written) == 1, written  # one serving process, one file
    snapshot = parse(written[0].read_text())
    assert snapshot["counters"]["rows_gathered"] > 0
    assert snapshot["counters"]["gather_calls"] > 0
    # one wait per step with rows for the gather thread; decode rows are gathered inline
    waits = snapshot["handshake_wait_seconds"]["count"]
    assert 0 < waits < snapshot["counters"]["gather_calls"]


def test_sparkple_row_ids_equal_vllm_compute_ngram_ids(equivalence: dict) -> None:
    assert equivalence["ngram_trials"] == 50
    assert equivalence["ngram_mismatched"] == 0


@pytest.mark.gpu
def test_cuda_path_equals_vllms_triton_kernel(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Pinned staging, the device copy and the NVFP4 decode on the GPU vs vLLM's own kernel."""
    skip_without_cuda()  # first: on a CPU machine that is the one reason it skips
    vllm_venv = request.getfixturevalue("vllm_venv")
    vllm_originals = request.getfixturevalue("vllm_originals")
    # a CUDA device is here, so a vLLM Python without CUDA torch or triton is a broken setup
    probe = [str(vllm_venv), "-c", "import torch, triton; print(torch.cuda.is_available())"]
    seen = subprocess.run(probe, capture_output=True, text=True)
    assert seen.stdout.strip() == "True", (
        f"{vllm_venv} has no CUDA torch with triton on this CUDA machine ({seen.stdout.strip()}"
        f"{seen.stderr.strip()[-400:]}): run it with a vLLM install that has them "
        "(make gpu-check sets SPARKPLE_VLLM_PYTHON)"
    )
    results = run_equivalence(vllm_venv, vllm_originals, tmp_path, "cuda", patch.DEFAULT_PROFILE)
    for result in (results["nvfp4"], results["fp8"]):
        assert result["device"] == "cuda"
        assert result["patched_backend"] == "Qwen4ExpPLEPackedTableEmbedding"
        assert result["patched_weight_devices"] == ["meta"]
        assert result["ngram_mismatched"] == 0  # vLLM's Triton hash on CUDA
        # on CUDA the stock path is vLLM's Triton lookup kernel itself
        assert all(result["float32_identical"]), result["float32_max_abs_diff"]
        assert all(result["bfloat16_identical"]), result["bfloat16_max_abs_diff"]
        assert result["float32_chunked_equals_whole"]
        assert result["dummy_outputs_zero"] == [True, True]


def test_fused_decode_is_bit_identical_to_the_torch_decode(vllm_venv: Path) -> None:
    """The forward's Triton decode (sparkple.runtime.nvfp4_triton), run by Triton's interpreter on
    CPU, against the torch decode: NVFP4 rows with subnormal, zero and the largest E4M3 block
    scales and FP8 rows, float32 and bfloat16, bit for bit."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}
    script = Path(__file__).resolve().parent / "fused_decode_check.py"
    proc = subprocess.run([str(vllm_venv), str(script)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    cases = {k: v for k, v in result.items() if "/" in k}
    assert len(cases) == 14  # 2 head dims x 2 dtypes x 3 global scales, FP8 x 2 dtypes
    for case, seen in cases.items():
        assert seen == {"shape_equal": True, "bits_equal": True, "nonzero": True}, case
    assert result["empty_shape"] == [0, 16, 160]
