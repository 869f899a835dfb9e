"""The serving unit's arguments through vLLM 0.34.0's own `vllm serve` parser (from the wheel).

The plans come from `sparkple serving-plan` on a synthetic snapshot in the HF cache layout (a
single Spark's, and a pair's head and worker, each with its multi-node flags); the
parser, `validate_parsed_serve_args` and `EngineArgs.from_cli_args` run in the CPU test venv
(`VLLM_TARGET_DEVICE=cpu`). molecule/default's verify runs tests/vllm/lab_container_args.py (not
collected otherwise) with the arguments the lab's serving container really received.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hf_snapshot import hf_cache_snapshot

from sparkple.pair.plan import Pair, PairNode
from sparkple.serving.budget import GIB, BudgetKnobs
from sparkple.serving.cli import PairRank, plan
from sparkple.serving.recipe import Recipe

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
# A pair's two nodes (sparkple.pair.plan): the production recipe per rank.
PAIR_CASES = {"pair-head": PairRank(0, "192.168.100.10", 29501),
              "pair-worker": PairRank(1, "192.168.100.10", 29501)}  # fmt: skip


def load_module(path: Path, name: str):
    """A script as a module, importing its neighbours as it does when run (sys.path[0])."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def run_check(vllm_venv: Path, cases: dict, work: Path) -> dict:
    request, result = work / "request.json", work / "result.json"
    request.write_text(json.dumps({"cases": cases}))
    # CUDA_VISIBLE_DEVICES empty: vLLM 0.34's CPU platform refuses to build an x86 engine
    # config without a Triton it can use (platforms/cpu.py), and counts the venv's CUDA Triton
    # only where no GPU is visible on purpose (triton_utils/importing.py); nothing here runs
    # a kernel, the config is all that is built
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    proc = subprocess.run([str(vllm_venv), str(CHECK), str(request), str(result)],
                          capture_output=True, text=True, env=env, cwd=work)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(result.read_text())


def expected_values(recipe: dict, util: float) -> dict:
    """What vLLM's parsed args must hold for a recipe (as sparkple.serving.recipe.Recipe fields)."""
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


# The tokens vLLM's qwen3 reasoning parser and qwen3_coder tool parser look up in the vocabulary
# when the engine config is built (ReasoningConfig tokenizes the think markers).
SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
)


def write_tokenizer(snapshot: Path) -> None:
    """A word-level tokenizer.json with the model's special tokens (the snapshot's own stand-in
    for the real tokenizer, which the synthetic checkpoint does not carry)."""
    vocab = {t: i for i, t in enumerate(("<unk>", *SPECIAL_TOKENS, "hello", "spark"))}
    added = [
        {"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": t.startswith("<|")}
        for t in SPECIAL_TOKENS
    ]  # fmt: skip
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
        "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }  # fmt: skip
    (snapshot / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
              "eos_token": "<|im_end|>", "model_max_length": 524_288}  # fmt: skip
    (snapshot / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    snap = hf_cache_snapshot(tmp_path_factory.mktemp("serve-args"), files=2, seed=11)
    write_tokenizer(snap)
    return snap


def replace_arg(argv: list[str], flag: str, value: str) -> list[str]:
    return [f"{flag}={value}" if a.startswith(f"{flag}=") else a for a in argv]


@pytest.fixture(scope="module")
def checked(vllm_venv: Path, snapshot: Path, tmp_path_factory) -> dict:
    plans, cases = {}, {}
    for name, (fields, knobs) in CASES.items():
        recipe = {"model": str(snapshot), "served_model_name": "qwen3.8-flash-next", **fields}
        r = Recipe(**{**recipe, "extra_args": tuple(recipe.get("extra_args", ()))})
        plans[name] = (recipe, plan(snapshot, r, BudgetKnobs(**knobs), MEMTOTAL))
        cases[name] = {"args": plans[name][1]["argv"], "config_dir": str(snapshot)}
    for name, rank in PAIR_CASES.items():
        recipe = {"model": str(snapshot), "served_model_name": "qwen3.8-flash-next"}
        plans[name] = (recipe, plan(snapshot, Recipe(**recipe), BudgetKnobs(), MEMTOTAL, rank))
        cases[name] = {"args": plans[name][1]["argv"], "config_dir": str(snapshot)}
    # a typo'd flag and mangled JSON (what systemd does to unquoted double quotes)
    good = plans["production"][1]["argv"]
    cases["typo"] = {"args": [*good, "--max-num-sequences=4"]}
    cases["mangled-json"] = {
        "args": [a.replace('"', "") if a.startswith("--speculative") else a for a in good]
    }
    # what vLLM's own config checks must refuse: a length beyond the YaRN factor's (the plan's
    # --hf-overrides scale the context to 524288; 786432 is past it), a KV dtype it does not know
    yarn = plans["fp8-kv-yarn"][1]["argv"]
    config_dir = str(snapshot)
    cases["beyond-yarn"] = {
        "args": replace_arg(yarn, "--max-model-len", "786432"),
        "config_dir": config_dir,
    }
    cases["bad-kv-dtype"] = {
        "args": replace_arg(good, "--kv-cache-dtype", "int8"),
        "config_dir": config_dir,
    }
    result = run_check(vllm_venv, cases, tmp_path_factory.mktemp("serve-check"))
    return {"plans": plans, **result}


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_parses_the_plan_to_the_recipe(checked: dict, name: str) -> None:
    recipe, the_plan = checked["plans"][name]
    case = checked["cases"][name]
    assert case["unknown"] == [], f"vLLM 0.34.0 does not know {case['unknown']}"
    assert case["error"] is None, case["error"]
    assert_matches(
        case["values"], expected_values(recipe, the_plan["budget"]["gpu_memory_utilization"])
    )  # noqa: E501
    assert case["engine"]["load_config"] == {
        "load_format": "safetensors",
        "safetensors_load_strategy": "lazy",
    }


@pytest.mark.parametrize("name", list(PAIR_CASES))
def test_vllm_parses_each_pair_nodes_plan(checked: dict, name: str) -> None:
    """The head's and the worker's argv, as serving-plan writes them, through vLLM's parser and
    `validate_parsed_serve_args`: every recipe value as on one Spark, plus the multi-node ones."""
    recipe, the_plan = checked["plans"][name]
    case = checked["cases"][name]
    assert case["unknown"] == [], f"vLLM 0.34.0 does not know {case['unknown']}"
    assert case["error"] is None, case["error"]
    values = case["values"]
    assert_matches(values, expected_values(recipe, the_plan["budget"]["gpu_memory_utilization"]))
    rank = PAIR_CASES[name].rank
    assert_matches(
        values,
        {"tensor_parallel_size": 2, "nnodes": 2, "node_rank": rank,
         "master_addr": "192.168.100.10", "master_port": 29501, "headless": rank == 1},
    )  # fmt: skip
    # and vLLM builds the node's engine config from it on a CPU: its ParallelConfig is TP 2
    # over two nodes, one rank on each, meeting at the head
    engine = case["engine"]
    assert engine.get("built"), {k: engine.get(k) for k in ("stopped_with", "stopped_in")}
    assert engine["parallel"] == {
        "tensor_parallel_size": 2, "world_size": 2, "nnodes": 2, "node_rank": rank,
        "master_addr": "192.168.100.10", "master_port": 29501,
        "distributed_executor_backend": "mp",
    }  # fmt: skip


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


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_builds_the_engine_config_of_each_plan_on_cpu(checked: dict, name: str) -> None:
    """create_engine_config from the snapshot's config.json runs to the end on a CPU: vLLM's
    ModelConfig (architecture inspection, max-length, dtype), its YaRN reading of
    --hf-overrides, the speculative, cache and scheduler configs, and the CPU platform's
    check_and_update_config."""
    recipe, the_plan = checked["plans"][name]
    engine = checked["cases"][name]["engine"]
    assert engine.get("built"), {k: engine.get(k) for k in ("stopped_with", "stopped_in")}
    r = Recipe(**{k: v for k, v in recipe.items() if k in Recipe.__dataclass_fields__})
    assert engine["architecture"] == "Qwen4ExpForConditionalGeneration"
    assert engine["max_model_len"] == r.max_model_len
    # the checkpoint's config has no dtype: vLLM's "auto" takes bfloat16
    assert engine["dtype"] == "torch.bfloat16"
    assert engine["kv_cache_dtype"] == r.kv_cache_dtype
    assert engine["mamba_ssm_cache_dtype"] == r.mamba_ssm_cache_dtype
    assert engine["max_num_seqs"] == r.max_num_seqs
    assert engine["max_num_batched_tokens"] == r.max_num_batched_tokens
    if r.max_model_len > 262_144:  # YaRN: vLLM derived the longer context from the overrides
        assert engine["rope_type"] == "yarn"
        assert engine["max_position_embeddings"] == r.max_model_len
    if r.mtp_depth:
        assert engine["speculative"] == {
            "method": "mtp",
            "num_speculative_tokens": r.mtp_depth,
            "draft_architecture": "Qwen4ExpMTP",
        }
    else:
        assert engine["speculative"] is None
    # what only a CUDA platform keeps: the CPU platform turns CUDA graphs off (the parsed
    # FULL_DECODE_ONLY is checked above, in test_vllm_parses_the_plan_to_the_recipe)
    assert engine["device_type"] == "cpu" and engine["cudagraph_mode"] == "NONE"


def test_vllm_refuses_a_max_model_len_beyond_the_yarn_factor(checked: dict) -> None:
    engine = checked["cases"]["beyond-yarn"]["engine"]
    assert engine["built"] is False
    assert engine["stopped_in"][-3:] == [
        "create_engine_config (arg_utils.py)",
        "create_model_config (arg_utils.py)",
        "__init__ (_dataclasses.py)",
    ]
    assert engine["stopped_with"].startswith(
        "ValidationError: 1 validation error for ModelConfig Value error, User-specified "
        "max_model_len (786432) is greater than the derived max_model_len "
        "(max_position_embeddings=524288.0 "
    ), engine["stopped_with"]


def test_vllm_refuses_a_kv_cache_dtype_it_does_not_know(checked: dict) -> None:
    case = checked["cases"]["bad-kv-dtype"]
    assert case["error"] is None, "the parser takes any string: CacheConfig is the check"
    engine = case["engine"]
    assert engine["built"] is False
    assert engine["stopped_in"][-2:] == [
        "create_engine_config (arg_utils.py)",
        "__init__ (_dataclasses.py)",
    ]
    assert engine["stopped_with"].startswith(
        "ValidationError: 1 validation error for CacheConfig cache_dtype Value error, "
        "Invalid kv_cache_dtype: 'int8'. Valid values are: ['auto', "
    ), engine["stopped_with"]


def test_lab_server_accepts_only_vllm_flags(checked: dict) -> None:
    lab = load_module(ROOT / "lab/lab_server.py", "lab_server_flags")
    flags = checked["flags"]
    for flag, kind in {**lab.ACCEPTED_FLAGS, **lab.PAIR_FLAGS}.items():
        assert flag in flags, f"the lab server accepts {flag}, which vLLM 0.34.0 does not know"
        assert flags[flag] == (kind is not None), f"{flag}: value-taking differs from vLLM"
    # every flag the recipe emits is one the lab server accepts
    for _recipe, the_plan in checked["plans"].values():
        for arg in the_plan["argv"][1:]:
            flag = arg.split("=", 1)[0]
            if flag in ("--enable-prefix-caching", "--default-chat-template-kwargs"):
                continue  # the "extra" case's free arguments
            assert flag in lab.ACCEPTED_FLAGS, f"the lab server would refuse {flag}"


# A pair of the inventory (sparkple.pair.plan): the head's link address is the rendezvous.
LAB_PAIR = Pair(
    name="lab",
    head=PairNode("spark-a", 0, "10.0.0.1", "enp1s0f1np1", "rocep1s0f1", 3),
    worker=PairNode("spark-b", 1, "10.0.0.2", "enp1s0f1np1", "rocep1s0f1", 3),
    master_port=29501,
)


@pytest.fixture(scope="module")
def pair_checked(vllm_venv: Path, checked: dict, tmp_path_factory) -> dict:
    """The production plan's argv with each node's multi-node words, through vLLM's parser."""
    argv = checked["plans"]["production"][1]["argv"]
    argvs = {host: [*argv, *LAB_PAIR.vllm_args(host)] for host in ("spark-a", "spark-b")}
    cases = {host: {"args": args} for host, args in argvs.items()}
    result = run_check(vllm_venv, cases, tmp_path_factory.mktemp("pair-check"))
    return {"argvs": argvs, **result}


def test_lab_server_takes_a_pairs_argvs_as_vllm_parses_them(pair_checked: dict) -> None:
    """Both nodes' argvs pass vLLM 0.34.0's parser, and the lab server reads the same pair
    from them: the head (node 0) and the headless worker (node 1) at the same rendezvous."""
    lab = load_module(ROOT / "lab/lab_server.py", "lab_server_pair")
    for host, argv in pair_checked["argvs"].items():
        case = pair_checked["cases"][host]
        assert case["unknown"] == [], f"vLLM 0.34.0 does not know {case['unknown']}"
        assert case["error"] is None, case["error"]
        rank = LAB_PAIR.node(host).rank
        values = case["values"]
        layout = (values["tensor_parallel_size"], values["nnodes"], values["node_rank"])
        assert layout == (2, 2, rank)
        assert (values["master_addr"], values["master_port"]) == ("10.0.0.1", 29501)
        assert values["headless"] is (rank == 1)
        assert values["distributed_executor_backend"] == "mp"
        side = lab.parse_args(argv).pair
        assert (side.rank, side.master_addr, side.master_port) == (rank, "10.0.0.1", 29501)
