"""The serving unit's arguments through vLLM 0.33.0's own `vllm serve` parser (from the wheel).

The plans come from `sparkple serving-plan` on a synthetic snapshot in the HF cache layout; the
parser, `validate_parsed_serve_args` and `EngineArgs.from_cli_args` run in the CPU test venv
(`VLLM_TARGET_DEVICE=cpu`). molecule/default's verify runs tests/vllm/lab_container_args.py (not
collected otherwise) with the arguments the lab's serving container really received.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
from hf_snapshot import hf_cache_snapshot

from sparkple.serving import GIB, BudgetKnobs, Recipe, plan

ROOT = Path(__file__).resolve().parents[2]
CHECK = Path(__file__).resolve().parent / "serve_args_check.py"
MEMTOTAL = int(119.7 * GIB)
# Each case: recipe fields on top of the production recipe, and the budget knobs.
CASES: dict[str, tuple[dict, dict]] = {
    "production": ({}, {}),
    "eight-seqs": ({"max_num_seqs": 8}, {"reserve_gib": 28}),
    "mtp-off": ({"mtp_depth": 0}, {}),
    "fp8-kv-yarn": ({"kv_cache_dtype": "fp8", "max_model_len": 524_288}, {}),
    "no-parsers": ({"reasoning_parser": "", "tool_call_parser": "", "chunked_prefill": True}, {}),
    "extra": (
        {
            "extra_args": (
                "--enable-prefix-caching",
                '--default-chat-template-kwargs={"enable_thinking":false}',
            )
        },
        {},
    ),  # noqa: E501
}


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_check(vllm_venv: Path, cases: dict, work: Path) -> dict:
    request, result = work / "request.json", work / "result.json"
    request.write_text(json.dumps({"cases": cases}))
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip
    proc = subprocess.run([str(vllm_venv), str(CHECK), str(request), str(result)],
                          capture_output=True, text=True, env=env, cwd=work)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(result.read_text())


def expected_values(recipe: dict, util: float) -> dict:
    """What vLLM's parsed args must hold for a recipe (as sparkple.serving.Recipe fields)."""
    fields = {k: v for k, v in recipe.items() if k in Recipe.__dataclass_fields__}
    r = Recipe(**{**fields, "extra_args": tuple(recipe.get("extra_args", ()))})
    return {
        "model": r.model,
        "served_model_name": [r.served_model_name],
        "host": r.host,
        "port": r.port,
        "max_model_len": r.max_model_len,
        "max_num_seqs": r.max_num_seqs,
        "max_num_batched_tokens": r.max_num_batched_tokens,
        "kv_cache_dtype": r.kv_cache_dtype,
        "mamba_ssm_cache_dtype": r.mamba_ssm_cache_dtype,
        "speculative_config": (
            {"method": "mtp", "num_speculative_tokens": r.mtp_depth} if r.mtp_depth else None
        ),
        "reasoning_parser": r.reasoning_parser,
        "tool_call_parser": r.tool_call_parser or None,
        "enable_auto_tool_choice": bool(r.tool_call_parser),
        "enable_chunked_prefill": r.chunked_prefill,
        "load_format": "safetensors",
        "safetensors_load_strategy": r.safetensors_load_strategy,
        "cudagraph_mode": r.cudagraph_mode,
        "distributed_executor_backend": "mp",
        "gpu_memory_utilization": util,
        "async_scheduling": None,
    }


def assert_matches(values: dict, want: dict) -> None:
    diff = {k: (values.get(k), v) for k, v in want.items() if values.get(k) != v}
    assert not diff, f"parsed by vLLM vs the recipe: {diff}"


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    return hf_cache_snapshot(tmp_path_factory.mktemp("serve-args"), files=2, seed=11)


@pytest.fixture(scope="module")
def checked(vllm_venv: Path, snapshot: Path, tmp_path_factory) -> dict:
    plans, cases = {}, {}
    for name, (fields, knobs) in CASES.items():
        recipe = {"model": str(snapshot), "served_model_name": "qwen3.8-flash-next", **fields}
        r = Recipe(**{**recipe, "extra_args": tuple(recipe.get("extra_args", ()))})
        plans[name] = (recipe, plan(snapshot, r, BudgetKnobs(**knobs), MEMTOTAL))
        cases[name] = {"args": plans[name][1]["argv"], "config_dir": str(snapshot)}
    # a typo'd flag and mangled JSON (what systemd does to unquoted double quotes)
    good = plans["production"][1]["argv"]
    cases["typo"] = {"args": [*good, "--max-num-sequences=4"]}
    cases["mangled-json"] = {
        "args": [a.replace('"', "") if a.startswith("--speculative") else a for a in good]
    }
    result = run_check(vllm_venv, cases, tmp_path_factory.mktemp("serve-check"))
    return {"plans": plans, **result}


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_parses_the_plan_to_the_recipe(checked: dict, name: str) -> None:
    recipe, the_plan = checked["plans"][name]
    case = checked["cases"][name]
    assert case["unknown"] == [], f"vLLM 0.33.0 does not know {case['unknown']}"
    assert case["error"] is None, case["error"]
    assert_matches(
        case["values"], expected_values(recipe, the_plan["budget"]["gpu_memory_utilization"])
    )  # noqa: E501
    assert case["engine"]["load_config"] == {
        "load_format": "safetensors",
        "safetensors_load_strategy": "lazy",
    }


def test_yarn_reaches_vllm_as_hf_overrides(checked: dict) -> None:
    values = checked["cases"]["fp8-kv-yarn"]["values"]
    rope = values["hf_overrides"]["text_config"]["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["factor"] == 2.0
    assert rope["original_max_position_embeddings"] == 262_144
    assert not checked["cases"]["production"]["values"]["hf_overrides"]


def test_the_check_catches_a_wrong_flag_and_mangled_json(checked: dict) -> None:
    assert checked["cases"]["typo"]["unknown"] == ["--max-num-sequences=4"]
    mangled = checked["cases"]["mangled-json"]
    assert mangled["unknown"] == [] and mangled["error"] is not None
    assert "speculative" in mangled["error"].lower() or "json" in mangled["error"].lower()


def test_engine_config_on_cpu_gets_to_the_model_config(checked: dict) -> None:
    """How far create_engine_config gets from the snapshot's config.json on a CPU-only venv."""
    engine = checked["cases"]["production"]["engine"]
    if engine.get("built"):
        assert engine["max_model_len"] == 262_144
        return
    # it read the snapshot's config.json through the HF cache symlinks and got into ModelConfig
    assert engine["model_config_reached"], engine
    print(f"create_engine_config stops: {engine['stopped_with']} in {engine['stopped_in'][-3:]}")


def test_lab_server_accepts_only_vllm_flags(checked: dict) -> None:
    lab = load_module(ROOT / "lab/lab_server.py", "lab_server_flags")
    flags = checked["flags"]
    for flag, kind in lab.ACCEPTED_FLAGS.items():
        assert flag in flags, f"the lab server accepts {flag}, which vLLM 0.33.0 does not know"
        assert flags[flag] == (kind is not None), f"{flag}: value-taking differs from vLLM"
    # every flag the recipe emits is one the lab server accepts
    for _recipe, the_plan in checked["plans"].values():
        for arg in the_plan["argv"][1:]:
            flag = arg.split("=", 1)[0]
            if flag in ("--enable-prefix-caching", "--default-chat-template-kwargs"):
                continue  # the "extra" case's free arguments
            assert flag in lab.ACCEPTED_FLAGS, f"the lab server would refuse {flag}"
