"""The serving plan of a pair's node: each rank's argv (the head's API, the worker headless) and
its budget (half the weights on each Spark), from `sparkple serving-plan` on a real synthetic
snapshot in the HF cache layout; and the single Spark's plan, unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hf_snapshot import hf_cache_snapshot

from sparkple.serving.budget import GIB, BudgetKnobs, SnapshotSizes, compute_budget
from sparkple.serving.cli import PairRank, plan
from sparkple.serving.recipe import ACCEPTED_FLAGS, OWNED_FLAGS, Recipe, ServingError

ROOT = Path(__file__).resolve().parents[2]
MEMTOTAL = int(119.7 * GIB)  # docs/two-sparks.md's worked examples
NVFP4 = SnapshotSizes(int(98.57 * GIB), int(26.82 * GIB), 0, 10, 1, None)
PAIR = ["--tensor-parallel-size=2", "--nnodes=2"]
RENDEZVOUS = ["--master-addr=192.168.100.10", "--master-port=29501"]


def recipe(**kw) -> Recipe:
    return Recipe(model="/models/m/snapshots/r", served_model_name="qwen3.8-flash-next", **kw)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    return hf_cache_snapshot(tmp_path_factory.mktemp("pair-plan"), files=2, seed=5)


# A small Spark for the synthetic snapshot (its weights are a few MB): the budget's knobs scaled
# down so that the halved weights show in the numbers.
SMALL = {"reserve_gib": 4, "kv_target_gib": 0, "overhead_gib": 0.5, "mtp_runtime_gib": 0.25,
         "host_floor_gib": 4, "slack_gib": 1, "launch_margin_gib": 1}  # fmt: skip


def test_each_rank_gets_its_multi_node_flags_and_a_per_rank_budget(snapshot: Path) -> None:
    r, knobs = recipe(), BudgetKnobs()
    single = plan(snapshot, r, knobs, MEMTOTAL)
    head = plan(snapshot, r, knobs, MEMTOTAL, PairRank(0, "192.168.100.10", 29501))
    worker = plan(snapshot, r, knobs, MEMTOTAL, PairRank(1, "192.168.100.10", 29501))
    backend = "--distributed-executor-backend=mp"
    for the_plan, rank, tail in ((head, 0, []), (worker, 1, ["--headless"])):
        argv = the_plan["argv"]
        i = argv.index(backend)
        words = [*PAIR, f"--node-rank={rank}", *RENDEZVOUS, *tail]
        assert argv[i + 1 : i + 1 + len(words)] == words
        # the rest is the single Spark's argv, word for word (the budget's fraction aside)
        rest = [a for a in argv if a.split("=")[0] not in ("--gpu-memory-utilization",)]
        assert [a for a in rest if a not in words] == [
            a for a in single["argv"] if not a.startswith("--gpu-memory-utilization")
        ]
        assert the_plan["pair"]["role"] == ("head", "worker")[rank]
        assert the_plan["summary"].startswith(f"Per rank (rank {rank} of 2, the pair's ")
        assert the_plan["budget"] == head["budget"]
    assert "--headless" not in head["argv"]
    assert not any(a.split("=")[0] in ("--nnodes", "--tensor-parallel-size", "--headless")
                   for a in single["argv"])  # fmt: skip
    assert "pair" not in single and not single["summary"].startswith("Per rank")


def test_the_readme_worked_example_per_rank() -> None:
    """docs/two-sparks.md: the NVFP4 checkpoint at the production recipe on 119.7 GiB Sparks."""
    one = compute_budget(NVFP4, recipe(), MEMTOTAL, BudgetKnobs())
    rank = compute_budget(NVFP4, recipe(), MEMTOTAL, BudgetKnobs(), tp_size=2)
    assert (one.weights_gib, rank.weights_gib) == (71.75, 35.875)
    assert rank.fixed_gib == pytest.approx(35.875 + 5.6 + 1.49, abs=0.001)
    assert rank.kv_need_gib == one.kv_need_gib
    assert (rank.gpu_memory_utilization, round(rank.kv_left_gib, 2)) == (0.493, 16.05)
    assert rank.container_memory_mib / 1024 == pytest.approx(67.01, abs=0.01)
    assert rank.launch_need_mib == rank.container_memory_mib + 4096
    # the KV target is the knob that turns the freed half into KV cache
    more = compute_budget(NVFP4, recipe(), MEMTOTAL, BudgetKnobs(kv_target_gib=48), tp_size=2)
    assert (more.gpu_memory_utilization, round(more.kv_left_gib, 2)) == (0.76, 48.01)
    assert more.container_memory_mib / 1024 == pytest.approx(98.97, abs=0.01)
    with pytest.raises(ServingError, match="tensor parallel size 4"):
        compute_budget(NVFP4, recipe(), MEMTOTAL, BudgetKnobs(), tp_size=4)


def test_the_pair_flags_are_the_pairs_alone() -> None:
    for flag in ("--tensor-parallel-size", "--nnodes", "--node-rank", "--master-addr",
                 "--master-port", "--headless"):  # fmt: skip
        assert flag in ACCEPTED_FLAGS and "the pair" in OWNED_FLAGS[flag]
    assert ACCEPTED_FLAGS["--headless"] is None and ACCEPTED_FLAGS["--master-port"] is int
    for args in (("--master-addr=10.0.0.1",), ("--node-rank", "1"), ("-tp", "2"), ("-n", "1"),
                 ("-r=0",), ("--master_port=1",)):  # fmt: skip
        with pytest.raises(ServingError, match="pair"):
            recipe(extra_args=args).check(mtp_layers=1)


def run_plan(snapshot: Path, *more: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "sparkple.cli", "serving-plan", str(snapshot), "--json",
           "--recipe", json.dumps({"model": "/m", "served_model_name": "x", **SMALL}),
           "--mem-total-bytes", str(24 * GIB), *more]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


def test_the_plan_command_takes_the_pair(snapshot: Path) -> None:
    single = run_plan(snapshot)
    assert single.returncode == 0, single.stderr
    proc = run_plan(snapshot, "--pair-rank", "1", "--master-addr", "10.0.0.1",
                    "--master-port", "29600")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    worker = json.loads(proc.stdout)
    assert worker["argv"][-1] != "--headless"  # the budget's fraction closes the argv
    assert "--headless" in worker["argv"] and "--master-port=29600" in worker["argv"]
    assert worker["pair"] == {"rank": 1, "master_addr": "10.0.0.1", "master_port": 29600,
                              "role": "worker", "tp_size": 2,
                              "vllm_args": [*PAIR, "--node-rank=1", "--master-addr=10.0.0.1",
                                            "--master-port=29600", "--headless"]}  # fmt: skip
    for more, message in (
        (("--pair-rank", "0"), "needs all of --pair-rank, --master-addr and --master-port"),
        (("--pair-rank", "2", "--master-addr", "a", "--master-port", "1"), "pair rank 2"),
        (("--pair-rank", "0", "--master-addr", "a", "--master-port", "0"), "not a TCP port"),
    ):
        proc = run_plan(snapshot, *more)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_the_documented_inventories_describe_a_valid_pair() -> None:
    """docs/two-sparks.md and inventory/example/hosts.yml's commented pair, as sparkple reads
    them (the same checks the roles' filter runs)."""
    import re

    import yaml

    from sparkple.pair.plan import pairs_of

    section = (ROOT / "docs" / "two-sparks.md").read_text()
    (block,) = re.findall(r"## The inventory\n.*?```yaml\n(.*?)```", section, re.S)
    example = (ROOT / "inventory/example/hosts.yml").read_text()
    commented = [line[6:] for line in example.splitlines() if line.startswith("    # ") and
                 re.match(r"    # ( {2})?[a-z_0-9-]+:", line)]  # fmt: skip
    uncommented = yaml.safe_load("\n".join(commented))
    for hosts in (yaml.safe_load(block)["sparks"]["hosts"], uncommented):
        (pair,) = pairs_of(hosts).values()
        assert (pair.head.host, pair.worker.host) == ("spark-04", "spark-05")
        assert pair.vllm_args("spark-05")[-1] == "--headless"
