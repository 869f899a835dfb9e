"""The packed table at tensor parallelism 2, on CPU: two real processes, vLLM's own groups.

Each rank (ple_tp.py) builds the rendered backend through vLLM's VocabParallelEmbedding on the
TP group that vLLM's `init_distributed_environment` and `initialize_model_parallel` set up over
gloo, and runs the equivalence tests' mixed batches; the same script with one rank is the
full-table reference. What only two GPUs can show (NCCL between two Sparks, CUDA graphs with
the all-reduce captured, the timings) is not tested here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkple import patch
from sparkple.builder.build import build_table
from sparkple.builder.synth import synth_checkpoint

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "ple_tp.py"
QUANTS = ("nvfp4", "fp8")
# NVFP4 rows are 90 B, FP8 rows 160 B: tables of 86 and 51 MiB, far more pages than one run's
# rows touch, so which pages a rank read shows
VOCAB_BASE = {"nvfp4": 60_000, "fp8": 20_000}
RUN_TIMEOUT_S = 900


def run_ranks(vllm_venv: Path, rendered: Path, work: Path, cases_per_rank: list[list[str]]):
    """One process per rank, all started before any is waited for (they rendezvous)."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{SCRIPT.parent}"}
    for name in ("SPARKPLE_PLE_TABLE_DIR", "SPARKPLE_STATS_DIR", "SPARKPLE_RELEASE_ID",
                 "SPARKPLE_PATCH_MANIFEST_SHA256"):  # fmt: skip
        env.pop(name, None)
    size = len(cases_per_rank)
    init_file = work / f"init-tp{size}"
    init_file.unlink(missing_ok=True)
    procs, outputs = [], []
    for rank, cases in enumerate(cases_per_rank):
        out = work / f"tp{size}-rank{rank}.json"
        log = open(work / f"tp{size}-rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        args = [str(vllm_venv), str(SCRIPT), "cpu", str(rendered), str(out)]
        args += [str(rank), str(size), str(init_file), *cases]
        procs.append((subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env), log))
        outputs.append(out)
    failed = []
    for rank, (proc, log) in enumerate(procs):
        code: int | str
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "timeout"
        log.close()
        if code != 0:
            failed.append(f"rank {rank} ({code}): {Path(log.name).read_text()[-4000:]}")
    assert not failed, "\n".join(failed)
    return [json.loads(out.read_text()) for out in outputs]


@pytest.fixture(scope="module")
def tp_results(vllm_venv: Path, vllm_originals: Path, tmp_path_factory) -> Iterator[dict]:
    work = tmp_path_factory.mktemp("ple-tp")
    rendered = work / "rendered"
    # no lookahead: which pages a run reads is then fixed by its steps alone (the lookahead's
    # advice runs on its own thread; tests/runtime covers it for a rank's rows)
    patch.render(patch.DEFAULT_PROFILE, vllm_originals, rendered, {"lookahead_mib": "0"})
    single, rank0, rank1 = [], [], []
    for quant in QUANTS:
        snapshot = synth_checkpoint(
            work / f"snapshot-{quant}", quant=quant, vocab_base=VOCAB_BASE[quant], files=2, seed=7
        )
        # each node builds its own table from its own copy: another build id, one fingerprint
        tables = [work / f"table-{quant}-node{n}" for n in (0, 1)]
        for table in tables:
            build_table(snapshot, table, quiet=True)
        single.append(f"{quant}={snapshot}={tables[0]}")
        rank0.append(f"{quant}={snapshot}={tables[0]}")
        rank1.append(f"{quant}={snapshot}={tables[1]}")
    # a pair whose nodes hold different checkpoint revisions, each table true to its own
    revisions = []
    for node, ranks in ((0, rank0), (1, rank1)):
        snapshot = synth_checkpoint(
            work / f"revision-{'ab'[node]}", quant="fp8", vocab_base=300, files=2, seed=20 + node
        )
        table = work / f"table-revision-{'ab'[node]}"
        build_table(snapshot, table, quiet=True)
        ranks.append(f"mismatch={snapshot}={table}")
        revisions.append((snapshot, table))
    # one node whose table is not its checkpoint's: it refuses, and its peer with it
    (snapshot_a, table_a), (_, table_b) = revisions
    rank0.append(f"one_side={snapshot_a}={table_a}")
    rank1.append(f"one_side={snapshot_a}={table_b}")
    (reference,) = run_ranks(vllm_venv, rendered, work, [single])
    pair = run_ranks(vllm_venv, rendered, work, [rank0, rank1])
    yield {"single": reference, "ranks": pair}
    shutil.rmtree(work, ignore_errors=True)  # about 500 MiB of tables


def test_vllm_sets_up_the_tp_group_on_cpu(tp_results: dict) -> None:
    for rank, result in enumerate(tp_results["ranks"]):
        assert result["etp_is_tp"]  # no embedding_across_dp: the PLE's group is the TP group
        for quant in QUANTS:
            assert result[quant]["backend"] == "Qwen4ExpPLEPackedTableEmbedding"
            assert result[quant]["tp"] == [rank, 2]


def test_each_rank_owns_half_of_the_padded_table(tp_results: dict) -> None:
    """vLLM's shard indices: contiguous halves, the first rank first; every row one owner."""
    for quant in QUANTS:
        reference = tp_results["single"][quant]
        first, second = (result[quant] for result in tp_results["ranks"])
        total = reference["total_rows"]
        assert reference["owned"] == [0, total]
        assert first["owned"] == [0, total // 2]
        assert second["owned"] == [total // 2, total]
        # the two nodes' tables: built apart (their own build ids), one fingerprint
        assert first["data_file"] != second["data_file"]
        assert first["fingerprint"] == second["fingerprint"] == reference["fingerprint"]


def test_pair_output_equals_single_rank_output_bit_for_bit(tp_results: dict) -> None:
    """Every step of the mixed batches (chunked prefill, decode, MTP drafts, a rejection,
    padding), NVFP4 and FP8, float32 and bfloat16: both ranks' combined rows are the
    single-rank full table's, byte for byte."""
    for quant in QUANTS:
        reference = tp_results["single"][quant]
        first, second = (result[quant] for result in tp_results["ranks"])
        assert len(reference["step_names"]) == 57
        assert first["step_names"] == second["step_names"] == reference["step_names"]
        for dtype in ("float32", "bfloat16"):
            assert first["steps"][dtype] == reference["steps"][dtype], (quant, dtype)
            assert second["steps"][dtype] == reference["steps"][dtype], (quant, dtype)
            assert len(set(reference["steps"][dtype])) > 50  # the steps differ from each other
        for result in (reference, first, second):
            assert result["every_step_nonzero"]
            assert result["padding_rows_zero"]
            # the forward with its all-reduce (vLLM's custom op) compiles as one graph
            assert result["compiled_equal"] == [True] * 4


def test_each_rank_reads_only_pages_of_its_own_rows(tp_results: dict) -> None:
    """mincore on each rank's table file after the run (evicted before it): no page outside
    the rank's row range, and each rank about half of the pages one rank reads alone."""
    for quant in QUANTS:
        reference = tp_results["single"][quant]
        alone = reference["pages"]["resident"]
        assert 0 < alone < reference["pages"]["pages"]  # the run reads a part of the table
        together = 0
        for result in (r[quant] for r in tp_results["ranks"]):
            pages = result["pages"]
            assert result["resident_before"] == 0.0
            assert pages["resident_outside_own_range"] == 0, (quant, pages)
            assert 0.35 * alone < pages["resident"] < 0.65 * alone, (quant, pages, alone)
            together += pages["resident"]
        # the two halves together are the pages one rank reads (a page the two ranges share,
        # read by both, at most)
        assert alone <= together <= alone + 1


def test_dummy_runs_sum_zeros_without_reading_rows(tp_results: dict) -> None:
    for quant in QUANTS:
        for result in (r[quant] for r in tp_results["ranks"]):
            assert result["dummy_output_zero"]
            assert result["dummy_counters_unchanged"]


def test_the_ranks_read_the_single_ranks_rows_between_them(tp_results: dict) -> None:
    """The PLE counters: each rank counts the rows it read, and the two together read every
    row one rank reads alone, each once."""
    for quant in QUANTS:
        alone = tp_results["single"][quant]["rows_gathered"]
        first, second = (r[quant]["rows_gathered"] for r in tp_results["ranks"])
        assert first + second == alone
        assert 0.4 * alone < first < 0.6 * alone


def test_a_pair_with_different_tables_refuses_to_start(tp_results: dict) -> None:
    """Two nodes on different checkpoint revisions, each table true to its own checkpoint:
    both ranks refuse at load, naming both sides and what differs."""
    for rank, result in enumerate(tp_results["ranks"]):
        error = result["mismatch"]["load_error"]
        assert error.startswith("TableError: the tensor-parallel ranks serve different PLE tables")
        assert "rank 0 on" in error and "rank 1 on" in error
        assert "revision-a" in error and "revision-b" in error
        assert "table-revision-a" in error and "table-revision-b" in error
        assert "global_scale" in error and "source" in error, rank


def test_a_rank_refusing_its_own_table_stops_its_peer_at_load(tp_results: dict) -> None:
    """Rank 1's table was built from another checkpoint than the one it loads: rank 1 names
    its own mismatch, and rank 0, whose table is fine, refuses with it instead of waiting for
    it in the next collective."""
    first, second = (result["one_side"]["load_error"] for result in tp_results["ranks"])
    assert second.startswith("ValueError: the packed PLE table")
    assert "does not match the checkpoint" in second and "global scale" in second
    assert first.startswith("TableError: rank 1 on ")
    assert "refused its PLE table: global scale" in first and "table-revision-b" in first


RELEASE = ("1f0c2a9be47d3e55", "a" * 64)
# rank 1's release in each case (rank 0 runs RELEASE); None: the unit names none
RELEASE_CASES = {
    "one_release": RELEASE,
    "other_release": ("7b3e90d1c2f4a685", "a" * 64),
    "other_manifest": ("1f0c2a9be47d3e55", "b" * 64),
    "unset": None,
}


@pytest.fixture(scope="module")
def release_results(
    vllm_venv: Path, vllm_originals: Path, tmp_path_factory
) -> Iterator[list[dict]]:
    """A pair on one small checkpoint, each node with its own build of the table: the two
    agree in everything but the release their units name."""
    work = tmp_path_factory.mktemp("ple-tp-release")
    rendered = work / "rendered"
    patch.render(patch.DEFAULT_PROFILE, vllm_originals, rendered, {"lookahead_mib": "0"})
    snapshot = synth_checkpoint(work / "snapshot", quant="fp8", vocab_base=300, files=2, seed=20)
    ranks: list[list[str]] = [[], []]
    for node, cases in enumerate(ranks):
        table = work / f"table-node{node}"
        build_table(snapshot, table, quiet=True)
        for name, other in RELEASE_CASES.items():
            release = RELEASE if node == 0 else other
            cases.append("=".join([name, str(snapshot), str(table), *(release or ())]))
    yield run_ranks(vllm_venv, rendered, work, ranks)
    shutil.rmtree(work, ignore_errors=True)


def test_a_pair_of_one_release_starts(release_results: list[dict]) -> None:
    for result in release_results:
        assert "load_error" not in result["one_release"], result["one_release"]
        assert result["one_release"]["backend"] == "Qwen4ExpPLEPackedTableEmbedding"


@pytest.mark.parametrize(
    ("case", "differ", "rank1_runs"),
    [
        ("other_release", "release id",
         "release 7b3e90d1c2f4a685, patch manifest sha256 " + "a" * 64),
        ("other_manifest", "patch manifest",
         "release 1f0c2a9be47d3e55, patch manifest sha256 " + "b" * 64),
        ("unset", "release id and patch manifest",
         "release (not set), patch manifest sha256 (not set)"),
    ],
)  # fmt: skip
def test_a_pair_of_two_releases_refuses_to_start_naming_both(
    release_results: list[dict], case: str, differ: str, rank1_runs: str
) -> None:
    """The rendered backend's own rank check over vLLM's TP group: both ranks refuse at load
    (one node rolled back, the other not), naming both ranks' hosts and releases."""
    for result in release_results:
        error = result[case]["load_error"]
        assert error.startswith(
            "ReleaseError: the tensor-parallel ranks run different releases: rank 0 on "
        ), error
        assert (
            " runs release 1f0c2a9be47d3e55, patch manifest sha256 " + "a" * 64 + " and rank 1 on "
        ) in error
        assert f" runs {rank1_runs} (they differ in {differ})" in error
