"""The PLE backend knob (sparkple_ple_backend): sparkple's packed table, or vLLM's own disk
offload and pinned-host table for A/B runs. Each backend's argv and plan from `sparkple
serving-plan` on a real synthetic snapshot, the refusals (each naming the knob), the patch
profile's vLLM bounding vllm-disk, and the budget counting vllm-pinned's table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hf_snapshot import hf_cache_snapshot

from sparkple.serving.budget import GIB, BudgetKnobs, SnapshotSizes, compute_budget
from sparkple.serving.cli import PairRank, from_spec, plan, variables
from sparkple.serving.recipe import (
    ACCEPTED_FLAGS,
    OWNED_FLAGS,
    Recipe,
    ServingError,
)
from sparkple.serving.served import profile_vllm_version

ROOT = Path(__file__).resolve().parents[2]
MEMTOTAL = int(119.7 * GIB)  # docs/serving.md's worked example
NVFP4 = SnapshotSizes(int(98.57 * GIB), int(26.82 * GIB), 0, 10, 1, None)
ENGRAM = {
    "packed": [],
    "vllm-disk": ['--engram-config={"disk_offload":true}'],
    "vllm-pinned": ['--engram-config={"cpu_offload":true}'],
}


def recipe(**kw) -> Recipe:
    return Recipe(model="/models/m/snapshots/r", served_model_name="qwen3.8-flash-next", **kw)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    return hf_cache_snapshot(tmp_path_factory.mktemp("ple-backend"), files=2, seed=9)


def serving_plan(snapshot: Path, spec: dict, *more: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sparkple.cli", "serving-plan", str(snapshot), "--json",
           "--recipe", json.dumps(spec), "--mem-total-bytes", str(MEMTOTAL), *more]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_each_backend_adds_its_engram_config_and_nothing_else(snapshot: Path) -> None:
    """The command the role runs: same recipe, the backend's --engram-config (none for the
    packed table) before the extra arguments, and the plan says whether the table is served."""
    base = {"model": "/m", "served_model_name": "x", "extra_args": ["--seed=7"]}
    argvs = {}
    for backend, engram in ENGRAM.items():
        run = serving_plan(snapshot, {**base, "ple_backend": backend}, "--patch-profile",
                           "vllm-0.34")  # fmt: skip
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        argvs[backend] = out["argv"]
        assert out["recipe"]["ple_backend"] == backend
        assert out["ple_backend"] == {"name": backend, "packed_table": backend == "packed",
                                      "patch_profile": "vllm-0.34"}  # fmt: skip
        assert [a for a in out["argv"] if a.startswith("--engram-config")] == engram
        assert out["argv"][-1] == "--seed=7"
    packed = argvs["packed"]
    for backend in ("vllm-disk", "vllm-pinned"):
        assert [a for a in argvs[backend] if a not in ENGRAM[backend]] == packed
        # the last of the recipe's fields, before the plan's own flags
        i = argvs[backend].index(ENGRAM[backend][0])
        assert argvs[backend][i - 1].startswith("--compilation-config=")
        assert argvs[backend][i + 1] == "--distributed-executor-backend=mp"
    # the role reads the knob from vllm_service_ple_backend (whose default is the site knob's)
    assert variables()["ple_backend"] == "vllm_service_ple_backend"
    assert recipe().ple_backend == "packed" and recipe().packed_table
    # the lab's server takes the flag; extra arguments may still give it with the packed table
    assert ACCEPTED_FLAGS["--engram-config"] == "json" and "--engram-config" not in OWNED_FLAGS
    recipe(extra_args=('--engram-config={"cpu_offload":false}',)).check(mtp_layers=1)


def test_an_unknown_backend_is_refused_naming_the_knob() -> None:
    r, _ = from_spec({"model": "/m", "served_model_name": "x", "ple_backend": "vllm-nvme"})
    with pytest.raises(ServingError, match=r"sparkple_ple_backend \(vllm_service_ple_backend\) "
                       r"is 'vllm-nvme': use one of packed, vllm-disk, vllm-pinned"):  # fmt: skip
        r.check(mtp_layers=1)


@pytest.mark.parametrize(
    "arg",
    [
        '--engram-config={"disk_offload": true}',
        '--engram-config={"disk-offload":true,"cpu_offload":false}',
        "--engram-config.disk_offload=true",
        "--engram-config.disk-offload",
    ],
)
def test_the_packed_table_refuses_vllms_disk_offload_beside_it(arg: str) -> None:
    with pytest.raises(ServingError) as err:
        recipe(extra_args=(arg,)).check(mtp_layers=1)
    message = str(err.value)
    assert arg in message
    assert "drop disk_offload from vllm_service_extra_args" in message
    assert "or set sparkple_ple_backend: vllm-disk" in message
    # the next argument as the value, too
    with pytest.raises(ServingError, match="drop disk_offload"):
        recipe(extra_args=("--engram-config", '{"disk_offload":true}')).check(mtp_layers=1)
    # off, or another key: served
    recipe(extra_args=('--engram-config={"disk_offload":false}',)).check(mtp_layers=1)


@pytest.mark.parametrize("backend", ["vllm-disk", "vllm-pinned"])
def test_vllms_backends_refuse_an_engram_config_of_the_extra_args(backend: str) -> None:
    for extra in (('--engram-config={"cpu_offload":false}',), ("--engram-config.disk_offload",),
                  ("--engram-config", '{"disk_offload":true}')):  # fmt: skip
        with pytest.raises(ServingError) as err:
            recipe(ple_backend=backend, extra_args=extra).check(mtp_layers=1)
        message = str(err.value)
        assert f"{ENGRAM[backend][0]} for sparkple_ple_backend {backend}" in message
        assert f"remove {extra[0]!r} from vllm_service_extra_args" in message
        assert "or set sparkple_ple_backend: packed" in message


@pytest.mark.parametrize("backend", ["packed", "vllm-disk", "vllm-pinned"])
@pytest.mark.parametrize("extra", [("--pipeline-parallel-size=2",), ("-pp", "2")])
def test_pipeline_parallel_stays_refused(backend: str, extra: tuple[str, ...]) -> None:
    with pytest.raises(ServingError, match="later pipeline ranks do not see the token ids.*"
                       "remove it from vllm_service_extra_args"):  # fmt: skip
        recipe(ple_backend=backend, extra_args=extra).check(mtp_layers=1)


def test_vllm_disk_needs_a_vllm_034_profile(snapshot: Path) -> None:
    assert profile_vllm_version("vllm-0.33") == (0, 33)
    assert profile_vllm_version("vllm-0.34") == (0, 34)  # its profile.yml's vllm_version
    assert profile_vllm_version(str(ROOT / "templates/vllm/vllm-0.34")) == (0, 34)
    assert profile_vllm_version("") is None
    disk = recipe(ple_backend="vllm-disk")
    for profile, said in (("vllm-0.33", "'vllm-0.33' (vLLM 0.33"),
                          ("", "'none' (its vLLM unknown")):  # fmt: skip
        with pytest.raises(ServingError) as err:
            plan(snapshot, disk, BudgetKnobs(), MEMTOTAL, patch_profile=profile)
        message = str(err.value)
        assert message.startswith(f"sparkple_ple_backend is vllm-disk, but the vLLM patch "
                                  f"profile is {said}")  # fmt: skip
        assert "needs vLLM 0.34 or later" in message
        assert "or set sparkple_ple_backend: packed or vllm-pinned" in message
    # through the command, as the role runs it: refused before anything is written
    spec = {"model": "/m", "served_model_name": "x", "ple_backend": "vllm-disk"}
    run = serving_plan(snapshot, spec, "--patch-profile", "vllm-0.33")
    assert run.returncode != 0 and run.stdout == ""
    assert "vllm-disk, but the vLLM patch profile is 'vllm-0.33'" in run.stderr
    assert plan(snapshot, disk, BudgetKnobs(), MEMTOTAL, patch_profile="vllm-0.34")["argv"]
    # the other backends under vllm-0.33
    for backend in ("packed", "vllm-pinned"):
        assert plan(snapshot, recipe(ple_backend=backend), BudgetKnobs(), MEMTOTAL,
                    patch_profile="vllm-0.33")["argv"]  # fmt: skip


def test_the_budget_refuses_vllm_pinned_on_one_spark_with_the_figure() -> None:
    """The Mia checkpoint on a 119.7 GiB Spark: the 26.82 GiB table pinned beside the 71.75
    GiB of weights leaves no KV cache (the packed table and vLLM's disk offload fit as today)."""
    packed = compute_budget(NVFP4, recipe(), MEMTOTAL, BudgetKnobs())
    disk = compute_budget(NVFP4, recipe(ple_backend="vllm-disk"), MEMTOTAL, BudgetKnobs())
    assert disk == packed and packed.pinned_table_gib == 0.0
    assert (packed.gpu_memory_utilization, packed.fixed_gib) == (0.782, 78.84)
    with pytest.raises(ServingError) as err:
        compute_budget(NVFP4, recipe(ple_backend="vllm-pinned"), MEMTOTAL, BudgetKnobs())
    message = str(err.value)
    assert message.startswith("the KV cache left (-12.05 GiB) cannot hold max_model_len 262144")
    assert ("weights 71.75 GiB + the PLE table pinned in host memory 26.82 GiB "
            "(sparkple_ple_backend vllm-pinned) + overhead 5.6 GiB + MTP 1.49 GiB = 105.66 GiB "
            "fixed") in message  # fmt: skip
    assert (
        "sparkple_ple_backend vllm-pinned pins the whole PLE table (26.82 GiB) in host "
        "memory beside the weights: set sparkple_ple_backend: packed or vllm-disk"
    ) in message
    # a pair's rank pins its half of the table, and fits
    rank = compute_budget(NVFP4, recipe(ple_backend="vllm-pinned"), MEMTOTAL, BudgetKnobs(),
                          tp_size=2)  # fmt: skip
    assert rank.pinned_table_gib == 13.41
    assert rank.fixed_gib == pytest.approx(35.875 + 13.41 + 5.6 + 1.49, abs=0.001)
    assert "pinned PLE table 13.41" in rank.summary()


def test_vllm_pinned_is_refused_by_the_plan_on_one_spark_and_planned_on_a_pair(
    snapshot: Path,
) -> None:
    """The plan as the role runs it, on a synthetic snapshot whose table is a larger share of
    a small Spark: the packed table fits, the pinned one does not; a pair's rank holds half."""
    sizes = plan(snapshot, recipe(), BudgetKnobs(), MEMTOTAL)["sizes"]
    table, files = sizes["table_bytes"], sizes["weight_files_bytes"]
    # a Spark sized so that the weights and the KV fit, the weights and the whole table do not
    per_token_bf16 = 29_482
    kv = 16 * per_token_bf16 / GIB
    weights = (files - table) / GIB
    knobs = BudgetKnobs(overhead_gib=0, mtp_runtime_gib=0, kv_target_gib=0, reserve_gib=0,
                        slack_gib=0, host_floor_gib=0, launch_margin_gib=0)  # fmt: skip
    mem_total = int((weights + kv + 0.6 * table / GIB) * GIB)
    small = {"max_model_len": 16, "mtp_depth": 0}
    assert plan(snapshot, recipe(**small), knobs, mem_total)["budget"]["pinned_table_gib"] == 0
    with pytest.raises(ServingError, match="vllm-pinned pins the whole PLE table"):
        plan(snapshot, recipe(ple_backend="vllm-pinned", **small), knobs, mem_total)
    head = plan(snapshot, recipe(ple_backend="vllm-pinned", **small), knobs, mem_total,
                PairRank(0, "192.168.100.10", 29501))  # fmt: skip
    assert head["budget"]["pinned_table_gib"] == round(table / 2 / GIB, 3)
    assert '--engram-config={"cpu_offload":true}' in head["argv"]
