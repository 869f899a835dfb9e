"""The arguments the lab's serving container really received, through vLLM 0.34.0's parser.

Run by molecule/default's verify with SPARKPLE_LAB_SERVE_ARGS naming the lab-args.json it wrote
(the container's Path and Args after systemd and docker, the plan's recipe): not a test_*.py
file, so a plain pytest run does not collect it (it would have nothing to check; a skip would
hide that under CI).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from sparkple.serving.recipe import Recipe

from .test_serve_args import assert_matches, expected_values, run_check, write_tokenizer

LAB_ARGS = os.environ.get("SPARKPLE_LAB_SERVE_ARGS", "")


def test_lab_container_args(vllm_venv: Path, tmp_path: Path) -> None:
    """The args docker delivered to the lab's serving container (after systemd's quoting)."""
    assert LAB_ARGS, "SPARKPLE_LAB_SERVE_ARGS must name the lab-args.json molecule/default wrote"
    lab = json.loads(Path(LAB_ARGS).read_text())
    args = lab["args"]
    # drop the entrypoint's own words: the lab image runs `python3 /opt/sparkple-lab/lab_server.py`
    # (`vllm serve` on a Spark: Path "vllm", first arg "serve")
    for words in (["/opt/sparkple-lab/lab_server.py"], ["serve"]):
        if args[: len(words)] == words:
            args = args[len(words) :]
    if lab.get("config_dir"):
        # the copy of the snapshot's config has no tokenizer; the reasoning parser needs one
        write_tokenizer(Path(lab["config_dir"]))
    case = {"args": args, "config_dir": lab.get("config_dir")}
    result = run_check(vllm_venv, {"lab": case}, tmp_path)["cases"]["lab"]
    assert result["unknown"] == [], f"vLLM 0.34.0 does not know {result['unknown']}"
    assert result["error"] is None, result["error"]
    recipe = lab["recipe"]
    # the lab serves the production recipe (only budget knobs and GPU flags differ)
    production = Recipe(model=recipe["model"], served_model_name="qwen3.8-flash-next")
    for key in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype",
                "mamba_ssm_cache_dtype", "mtp_depth", "reasoning_parser", "tool_call_parser",
                "cudagraph_mode", "safetensors_load_strategy", "chunked_prefill",
                "served_model_name"):  # fmt: skip
        assert recipe[key] == getattr(production, key), key
    want = expected_values(recipe, lab["gpu_memory_utilization"])
    assert_matches(result["values"], want)
    engine = result["engine"]
    print(json.dumps({"engine": engine}, indent=1))
    # vLLM's create_engine_config builds the whole VllmConfig from these args on a CPU
    assert engine.get("built"), engine
    assert engine["max_model_len"] == recipe["max_model_len"], engine
    assert engine["architecture"] == "Qwen4ExpForConditionalGeneration", engine
