"""The serving plan (sparkple.serving: recipe and budget): the budget formula with the figures of
docs/reference-deployment.md#memory-budget, the refusals, the recipe's checks and argv, sizes
read from a real synthetic snapshot in the HF cache layout, and the launch gate on meminfo files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
from hf_snapshot import hf_cache_snapshot

from sparkple.serving.budget import (
    GIB,
    BudgetKnobs,
    SnapshotSizes,
    compute_budget,
    launch_gate,
    snapshot_sizes,
)
from sparkple.serving.cli import from_spec, variables
from sparkple.serving.recipe import Recipe, ServingError

ROOT = Path(__file__).resolve().parents[2]
MEMTOTAL = int(119.7 * GIB)  # docs/serving.md's worked example


def sizes(snapshot_gib: float, table_gib: float, mtp_gib: float = 0.0) -> SnapshotSizes:
    return SnapshotSizes(
        int(snapshot_gib * GIB), int(table_gib * GIB), int(mtp_gib * GIB), 10, 1, None
    )


def recipe(**kw) -> Recipe:
    return Recipe(model="/models/m/snapshots/r", served_model_name="qwen3.8-flash-next", **kw)


NVFP4 = sizes(98.57, 26.82)
FP8 = sizes(71.75 + 47.68, 47.68, 2.34)


def test_budget_nvfp4_four_sequences_matches_the_formula() -> None:
    b = compute_budget(NVFP4, recipe(), MEMTOTAL, BudgetKnobs())
    assert b.weights_gib == pytest.approx(71.75, abs=0.01)
    assert b.fixed_gib == pytest.approx(71.75 + 5.6 + 1.49, abs=0.01)
    assert b.kv_need_gib == pytest.approx(262_144 * 29_482 / GIB, abs=0.001)
    assert b.wish_gib == pytest.approx(b.fixed_gib + 16.0, abs=0.01)  # the KV target wins
    # the wish (94.84) is above the cap (119.7 - 26 = 93.7): the cap, floored
    assert b.gpu_memory_utilization == 0.782  # floor((119.7 - 26) / 119.7, 3 decimals)
    assert b.budget_gib == pytest.approx(0.782 * 119.7, abs=0.001)
    assert b.kv_left_gib == pytest.approx(b.budget_gib - b.fixed_gib, abs=0.002)
    assert b.container_memory_mib == pytest.approx((b.budget_gib + 8) * 1024, abs=1)
    assert b.launch_need_mib == b.container_memory_mib + 4096


def test_budget_eight_sequences_and_the_fp8_table() -> None:
    eight = compute_budget(NVFP4, recipe(max_num_seqs=8), MEMTOTAL, BudgetKnobs(reserve_gib=28))
    assert eight.gpu_memory_utilization == 0.766
    fp8 = compute_budget(FP8, recipe(), MEMTOTAL, BudgetKnobs(reserve_gib=30))
    assert fp8.weights_gib == pytest.approx(71.75, abs=0.01)  # the 47.68 GiB table is not weights
    assert fp8.gpu_memory_utilization == 0.749


def test_mtp_off_drops_its_weights_and_runtime() -> None:
    on = compute_budget(FP8, recipe(), MEMTOTAL, BudgetKnobs(reserve_gib=30))
    off = compute_budget(FP8, recipe(mtp_depth=0), MEMTOTAL, BudgetKnobs(reserve_gib=30))
    assert on.fixed_gib - off.fixed_gib == pytest.approx(2.34 + 1.49, abs=0.01)


def test_fp8_kv_needs_058_of_bf16() -> None:
    bf16 = compute_budget(NVFP4, recipe(), MEMTOTAL, BudgetKnobs())
    fp8 = compute_budget(NVFP4, recipe(kv_cache_dtype="fp8"), MEMTOTAL, BudgetKnobs())
    assert fp8.kv_need_gib == pytest.approx(bf16.kv_need_gib * 0.58, abs=0.001)


def test_refused_when_the_kv_left_cannot_hold_max_model_len() -> None:
    with pytest.raises(ServingError) as err:
        compute_budget(NVFP4, recipe(max_model_len=524_288), MEMTOTAL, BudgetKnobs(reserve_gib=30))
    text = str(err.value)
    assert "cannot hold max_model_len 524288" in text
    assert "vllm_service_kv_cache_dtype" in text and "vllm_service_max_model_len" in text
    # fp8 KV makes the same context fit
    compute_budget(
        NVFP4, recipe(max_model_len=524_288, kv_cache_dtype="fp8"), MEMTOTAL, BudgetKnobs()
    )


def test_refused_when_the_container_exceeds_what_the_host_can_give() -> None:
    with pytest.raises(ServingError, match="above MemTotal 119.70 - host floor 16"):
        compute_budget(NVFP4, recipe(), MEMTOTAL, BudgetKnobs(reserve_gib=10, slack_gib=12))


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"max_model_len": 600_000}, "vllm_service_max_model_len"),
        ({"max_model_len": 300_000}, "YaRN scales by a whole factor"),
        ({"kv_cache_dtype": "fp8_e5m2"}, "vllm_service_kv_cache_dtype"),
        ({"cudagraph_mode": "full"}, "vllm_service_cudagraph_mode"),
        ({"mtp_depth": 9}, "vllm_service_mtp_depth"),
        ({"max_num_batched_tokens": 2}, "vllm_service_max_num_batched_tokens"),
        ({"extra_args": ("--max-num-seqs=8",)}, "vllm_service_max_num_seqs"),
        ({"extra_args": ("--pipeline-parallel-size=2",)}, "later pipeline ranks"),
        ({"extra_args": ("-tp", "2")}, "serves one rank"),
        ({"extra_args": ("-tp", "1")}, "two Sparks as a pair"),
        ({"extra_args": ("--tensor-parallel-size=1",)}, "the pair (sparkple_pair"),
        ({"extra_args": ("--nnodes=2",)}, "the pair (sparkple_pair"),
        ({"extra_args": ("--headless",)}, "the pair (sparkple_pair"),
        ({"extra_args": ("--prefill-context-parallel-size", "4")}, "split across ranks"),
        ({"extra_args": ("--enable-dbo",)}, "micro-batch"),
        ({"extra_args": ('--engram-config={"embedding_across_dp": true}',)}, "embedding_across_dp"),
        ({"extra_args": ("--engram-config.embedding_across_dp=true",)}, "embedding_across_dp"),
        ({"extra_args": ("--engram-config.embedding-across-dp", "true")}, "embedding_across_dp"),
        (
            {"extra_args": ("--engram-config", '{"embedding_across_dp": true}')},
            "embedding_across_dp",
        ),
        ({"extra_args": ("--gpu_memory_utilization=0.9",)}, "the budget"),
        # load paths that read the PLE row shards
        ({"safetensors_load_strategy": "eager"}, "--safetensors-load-strategy=eager reads each"),
        ({"safetensors_load_strategy": "prefetch"}, "--safetensors-load-strategy=prefetch reads"),
        (
            {"extra_args": ('--model-loader-extra-config={"enable_multithread_load": true}',)},
            "multi-thread loader",
        ),
        (
            {"extra_args": ("--model-loader-extra-config.enable-multithread-load", "true")},
            "multi-thread loader",
        ),
        ({"extra_args": ("--x\n--y",)}, "no newlines"),
    ],
)
def test_recipe_refusals_name_the_knob(kw: dict, needle: str) -> None:
    with pytest.raises(ServingError) as err:
        recipe(**kw).check(mtp_layers=1)
    assert needle in str(err.value)


def test_mtp_depth_must_suit_the_checkpoints_layers() -> None:
    recipe(mtp_depth=3).check(mtp_layers=1)
    recipe(mtp_depth=4).check(mtp_layers=2)
    with pytest.raises(ServingError, match="multiple of 2"):
        recipe(mtp_depth=3).check(mtp_layers=2)
    with pytest.raises(ServingError, match="no MTP layers"):
        recipe(mtp_depth=1).check(mtp_layers=0)
    # async scheduling is served, with MTP too (the PLE step copies the inputs vLLM's forward
    # reads); so are pipeline sizes of 1 and an engram config that keeps one table per rank
    # (the tensor-parallel size is the pair's: refused in the extra arguments whatever its value)
    recipe(mtp_depth=3, extra_args=("--async-scheduling",)).check(mtp_layers=1)
    recipe(extra_args=("--pipeline-parallel-size=1", "-pp", "1")).check(mtp_layers=1)
    recipe(extra_args=('--engram-config={"cpu_offload": false}',)).check(mtp_layers=1)
    recipe(extra_args=("--engram-config.embedding_across_dp", "false")).check(mtp_layers=1)


def test_argv_is_the_recipe() -> None:
    argv = recipe().argv(0.782)
    assert argv[0] == "/models/m/snapshots/r"
    assert '--speculative-config={"method":"mtp","num_speculative_tokens":3}' in argv
    assert '--compilation-config={"cudagraph_mode":"FULL_DECODE_ONLY"}' in argv
    assert "--enable-auto-tool-choice" in argv and "--tool-call-parser=qwen3_coder" in argv
    assert "--gpu-memory-utilization=0.782" in argv
    assert not any(a.startswith("--hf-overrides") for a in argv)
    off = recipe(mtp_depth=0, tool_call_parser="", reasoning_parser="").argv(0.5)
    assert not any(
        a.startswith(("--speculative", "--tool", "--enable-auto", "--reasoning")) for a in off
    )


def test_yarn_keeps_the_checkpoints_rope_parameters() -> None:
    argv = recipe(max_model_len=524_288).argv(0.7, {"rope_theta": 1e7, "rope_type": "default"})
    (over,) = [a for a in argv if a.startswith("--hf-overrides=")]
    params = json.loads(over.split("=", 1)[1])["text_config"]["rope_parameters"]
    assert params == {
        "rope_theta": 1e7,
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 262_144,
    }


@pytest.fixture(scope="module")
def hf_snapshot(tmp_path_factory) -> Path:
    """A synthetic checkpoint published in the HF cache layout (blobs + relative symlinks)."""
    return hf_cache_snapshot(tmp_path_factory.mktemp("hf"), files=3, seed=3)


def test_the_layout_is_snapshot_downloads(hf_snapshot: Path) -> None:
    entries = sorted(hf_snapshot.iterdir())
    assert entries and all(p.is_symlink() for p in entries)
    for p in entries:
        target = Path(p.readlink())
        assert target.parts[:3] == ("..", "..", "blobs") and p.resolve().is_file()
    assert not (hf_snapshot.parent / "rev.partial").exists()


def test_sizes_come_from_the_headers(hf_snapshot: Path) -> None:
    s = snapshot_sizes(hf_snapshot)
    files = [p for p in hf_snapshot.iterdir() if p.name.endswith(".safetensors")]
    assert s.files == len(files) == 3
    assert s.weight_files_bytes == sum(p.stat().st_size for p in files)
    # 90 B per row (80 codes + 10 scales) over every shard
    assert s.table_bytes > 0 and s.table_bytes % 90 == 0
    assert s.table_bytes < s.weight_files_bytes


def test_a_dangling_snapshot_is_refused(tmp_path: Path, hf_snapshot: Path) -> None:
    # only snapshots/<rev> without its blobs: what the old unit mounted
    copy = tmp_path / "snap"
    copy.mkdir()
    for p in hf_snapshot.iterdir():
        (copy / p.name).symlink_to(p.readlink())
    with pytest.raises(ServingError, match="dangling symlink"):
        snapshot_sizes(copy)


def test_plan_command_prints_argv_and_budget(hf_snapshot: Path) -> None:
    spec = {"model": "/m", "served_model_name": "qwen3.8-flash-next", "reserve_gib": 4,
            "kv_target_gib": 0, "overhead_gib": 0.5, "mtp_runtime_gib": 0.25, "host_floor_gib": 4,
            "slack_gib": 1, "launch_margin_gib": 1}  # fmt: skip
    cmd = [sys.executable, "-m", "sparkple.cli", "serving-plan", str(hf_snapshot), "--json",
           "--recipe", json.dumps(spec), "--mem-total-bytes", str(24 * GIB)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    # below the cap the fraction is rounded up: the KV left holds max_model_len
    assert plan["budget"]["kv_left_gib"] >= plan["budget"]["kv_need_gib"]
    assert plan["argv"][0] == "/m"
    # the recipe as the plan typed it (what the role records)
    assert plan["recipe"]["reserve_gib"] == 4.0 and plan["recipe"]["max_num_seqs"] == 4
    util = plan["budget"]["gpu_memory_utilization"]
    assert f"--gpu-memory-utilization={util}" in plan["argv"]
    spec["max_model_len"] = 524_288
    spec["reserve_gib"] = 16
    proc = subprocess.run(cmd[:-3] + [json.dumps(spec)] + cmd[-2:], capture_output=True,
                          text=True, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 1
    assert "cannot hold max_model_len 524288" in proc.stderr


def test_launch_gate_reads_memavailable(tmp_path: Path) -> None:
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       125515776 kB\nMemAvailable:    8388608 kB\n")
    ok, message = launch_gate(8192, info)
    assert ok, message
    ok, message = launch_gate(8193, info)
    assert not ok and "MemAvailable 8192 MiB < 8193 MiB" in message
    cmd = [sys.executable, "-m", "sparkple.cli", "launch-gate", "--need-mib", "9000",
           "--meminfo", str(info)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1 and "not starting vLLM" in proc.stderr


def test_readme_worked_example() -> None:
    """docs/serving.md's table (MemTotal 119.7 GiB): utilization, KV left and container per row."""
    rows = [
        (NVFP4, 4, 26, 0.782, 14.77, 101.61),
        (NVFP4, 8, 28, 0.766, 12.85, 99.69),
        (FP8, 4, 30, 0.749, 10.81, 97.66),
        (FP8, 8, 30, 0.749, 10.81, 97.66),
    ]
    for snap, seqs, reserve, util, kv_left, container in rows:
        b = compute_budget(
            snap, recipe(max_num_seqs=seqs), MEMTOTAL, BudgetKnobs(reserve_gib=reserve)
        )
        assert (b.gpu_memory_utilization, round(b.kv_left_gib, 2)) == (util, kv_left)
        assert b.container_memory_mib / 1024 == pytest.approx(container, abs=0.01)
    yarn = recipe(max_model_len=524_288)
    assert compute_budget(NVFP4, yarn, MEMTOTAL, BudgetKnobs()).kv_need_gib == pytest.approx(
        14.40, abs=0.01
    )  # noqa: E501
    with pytest.raises(ServingError, match="cannot hold"):
        compute_budget(NVFP4, yarn, MEMTOTAL, BudgetKnobs(reserve_gib=28))
    fp8 = recipe(max_model_len=524_288, kv_cache_dtype="fp8")
    b = compute_budget(FP8, fp8, MEMTOTAL, BudgetKnobs(reserve_gib=30))
    assert b.kv_need_gib == pytest.approx(8.35, abs=0.01)


def role_variables() -> dict:
    """What the roles define by default: vllm_service's defaults and vars, sparkple_common's."""
    import yaml

    found: dict = {}
    for part in ("vllm_service/defaults", "vllm_service/vars", "sparkple_common/defaults"):
        found.update(yaml.safe_load((ROOT / "roles" / part / "main.yml").read_text()))
    return found


def test_every_recipe_key_is_read_from_a_variable_the_roles_define() -> None:
    """vllm_service passes --recipe as {key: value of variables()[key]}: each must exist."""
    defined = role_variables()
    missing = {key: var for key, var in variables().items() if var not in defined}
    assert not missing, f"the recipe reads variables no role defines: {missing}"
    assert set(variables()) == set(Recipe.__dataclass_fields__) | set(
        BudgetKnobs.__dataclass_fields__
    )


def test_role_defaults_are_the_packages_recipe_and_budget() -> None:
    """vllm_service's defaults (and sparkple_common's served name) and sparkple.serving's cannot
    drift apart."""
    import yaml

    defaults = yaml.safe_load((ROOT / "roles/vllm_service/defaults/main.yml").read_text())
    shared = yaml.safe_load((ROOT / "roles/sparkple_common/defaults/main.yml").read_text())
    defined = role_variables()
    r = recipe()
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype",
                 "mamba_ssm_cache_dtype", "mtp_depth", "reasoning_parser", "tool_call_parser",
                 "cudagraph_mode", "safetensors_load_strategy", "chunked_prefill"):  # fmt: skip
        assert defaults[f"vllm_service_{name}"] == getattr(r, name), name
    assert shared["sparkple_served_model_name"] == r.served_model_name
    # every field with a default, from whichever role defines its variable (a role default that
    # takes a site knob's value, `{{ knob | default(X) }}`, is X where the site sets none)
    for cls, instance in ((Recipe, r), (BudgetKnobs, BudgetKnobs())):
        for f in fields(cls):
            if f.default is not MISSING:
                value = defined[f.metadata["var"]]
                knob = re.fullmatch(r"\{\{ \w+ \| default\('([^']*)'\) \}\}", str(value))
                assert (knob.group(1) if knob else value) == getattr(instance, f.name), f.name
    k = BudgetKnobs()
    knob_vars = {"reserve_gib": "memtotal_reserve_gib", "slack_gib": "memory_slack_gib"}
    for name in BudgetKnobs.__dataclass_fields__:
        assert defaults[f"vllm_service_{knob_vars.get(name, name)}"] == getattr(k, name), name
    assert shared["sparkple_health_gate_timeout_s"] == 1800
    checkpoint = yaml.safe_load((ROOT / "roles/model_checkpoint/defaults/main.yml").read_text())
    assert checkpoint["model_checkpoint_repo"] == "Mia-AiLab/Qwen3.8-Flash-Next-NVFP4"


def test_recipe_values_from_the_inventory_are_typed_as_the_fields() -> None:
    """`-e vllm_service_max_num_seqs=8` reaches the plan as a string: typed as Ansible's filters
    type it; anything that is not the field's type is refused, naming the variable."""
    given = {"model": "/m", "served_model_name": "x", "max_num_seqs": "8",
             "chunked_prefill": "no", "reserve_gib": "28", "extra_args": ["--a"]}  # fmt: skip
    r, k = from_spec(given)
    assert (r.max_num_seqs, r.chunked_prefill, k.reserve_gib) == (8, False, 28.0)
    assert r.extra_args == ("--a",)
    for key, value, want in (("max_num_seqs", "eight", "use a number"),
                             ("max_num_seqs", 8.5, "use a whole number"),
                             ("chunked_prefill", "maybe", "use true or false"),
                             ("extra_args", "--a", "use a list"),
                             ("reserve_gib", True, "use a number")):  # fmt: skip
        with pytest.raises(ServingError, match=f"{variables()[key]} .*{want}"):
            from_spec({"model": "/m", "served_model_name": "x", key: value})
    with pytest.raises(ServingError, match="unknown keys"):
        from_spec({"model": "/m", "served_model_name": "x", "max_num_sequences": 8})
