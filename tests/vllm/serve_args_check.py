"""Parse a `vllm serve` argument list with vLLM 0.34.0's own parser (run in the vLLM test venv).

Usage: serve_args_check.py REQUEST.json RESULT.json
REQUEST: {"cases": {NAME: {"args": [...], "config_dir": "<a local snapshot dir or null>"}}}
RESULT:  {"flags": {...}, "cases": {NAME: {"unknown": [...], "error": str|null, "values": {...},
          "engine": {...}}}}

`args` are what the entrypoint `vllm serve` receives after its own words. The parser is the one
`vllm serve` builds (make_arg_parser on a FlexibleArgumentParser); unknown arguments are
collected with parse_known_args first, then parse_args, validate_parsed_serve_args and
EngineArgs.from_cli_args run as the server runs them. With `config_dir` (a local copy of the
snapshot's config.json and index), the parsed model path (the container's) is swapped for it
before EngineArgs is built, and create_engine_config goes as far as vLLM gets on a CPU-only
machine: on CPU it builds the whole VllmConfig (what it holds is reported), or where it stops
and with which message is. `flags` maps every option string of the parser to
whether it takes a value (for the lab server's accepted set).
"""

from __future__ import annotations

import importlib
import io
import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# The module vLLM imports to inspect Qwen4ExpForConditionalGeneration.
MODEL_MODULE = "vllm.models.qwen4_exp.nvidia.model"


def check(parser, request: dict) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import validate_parsed_serve_args

    result: dict = {"unknown": [], "error": None, "values": {}, "engine": {}}
    args = list(request["args"])
    # argparse prints its error and exits: keep the message for the report
    real_stderr, stderr = sys.stderr, io.StringIO()
    sys.stderr = stderr
    try:
        _, unknown = parser.parse_known_args(args)
        result["unknown"] = unknown
        if unknown:
            return result
        ns = parser.parse_args(args)
        if ns.model_tag is not None:  # as `vllm serve` does (entrypoints/cli/serve.py)
            ns.model = ns.model_tag
        validate_parsed_serve_args(ns)
        parsed_model = ns.model
        if request.get("config_dir"):
            # the path is the container's: EngineArgs reads the model's config from a local copy
            ns.model = request["config_dir"]
        engine_args = AsyncEngineArgs.from_cli_args(ns)
    except (SystemExit, Exception) as exc:  # noqa: BLE001 - reported, the test asserts
        result["error"] = f"{type(exc).__name__}: {exc} {stderr.getvalue()[-600:]}"
        return result
    finally:
        sys.stderr = real_stderr
    comp = engine_args.compilation_config
    mode = getattr(comp, "cudagraph_mode", None)
    result["values"] = {
        "model": parsed_model,
        "served_model_name": engine_args.served_model_name,
        "host": ns.host,
        "port": ns.port,
        "max_model_len": engine_args.max_model_len,
        "max_num_seqs": engine_args.max_num_seqs,
        "max_num_batched_tokens": engine_args.max_num_batched_tokens,
        "kv_cache_dtype": engine_args.kv_cache_dtype,
        "mamba_ssm_cache_dtype": engine_args.mamba_ssm_cache_dtype,
        "speculative_config": engine_args.speculative_config,
        "reasoning_parser": engine_args.reasoning_parser,
        "tool_call_parser": ns.tool_call_parser,
        "enable_auto_tool_choice": ns.enable_auto_tool_choice,
        "enable_chunked_prefill": engine_args.enable_chunked_prefill,
        "load_format": engine_args.load_format,
        "safetensors_load_strategy": engine_args.safetensors_load_strategy,
        "cudagraph_mode": getattr(mode, "name", None if mode is None else str(mode)),
        "distributed_executor_backend": engine_args.distributed_executor_backend,
        "gpu_memory_utilization": engine_args.gpu_memory_utilization,
        "hf_overrides": engine_args.hf_overrides,
        "async_scheduling": engine_args.async_scheduling,
        # the multi-node words of a pair (sparkple.pair.plan)
        "tensor_parallel_size": engine_args.tensor_parallel_size,
        "nnodes": engine_args.nnodes,
        "node_rank": engine_args.node_rank,
        "master_addr": engine_args.master_addr,
        "master_port": engine_args.master_port,
        "headless": ns.headless,
    }
    engine: dict = {}
    try:
        load = engine_args.create_load_config()
        engine["load_config"] = {
            "load_format": str(load.load_format),
            "safetensors_load_strategy": load.safetensors_load_strategy,
        }
    except Exception as exc:  # noqa: BLE001
        engine["load_config_error"] = f"{type(exc).__name__}: {exc}"
    if request.get("config_dir"):
        try:
            config = engine_args.create_engine_config()
            engine["built"] = True
            engine.update(engine_values(config))
        except (SystemExit, Exception) as exc:  # noqa: BLE001 - where vLLM stops on a CPU
            engine["built"] = False
            frames = traceback.extract_tb(exc.__traceback__)
            engine["stopped_in"] = [f"{f.name} ({os.path.basename(f.filename)})" for f in frames]
            engine["stopped_with"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
            engine["model_config_reached"] = any(f.name == "create_model_config" for f in frames)
            # ModelConfig inspects the architecture by importing the model's module: say why
            # that import fails here (vLLM logs it, the exception does not carry it)
            try:
                importlib.import_module(MODEL_MODULE)
                engine["model_module_import"] = "ok"
            except Exception as err:  # noqa: BLE001
                engine["model_module_import"] = f"{type(err).__name__}: {err}"
    result["engine"] = engine
    return result


def engine_values(config) -> dict:
    """What the built VllmConfig holds, after vLLM's own checks and the CPU platform's changes."""
    model = config.model_config
    spec = config.speculative_config
    rope = getattr(model.hf_text_config, "rope_parameters", None)
    return {
        "max_model_len": model.max_model_len,
        "architecture": model.architecture,
        "dtype": str(model.dtype),
        "max_position_embeddings": getattr(model.hf_text_config, "max_position_embeddings", None),
        "rope_type": rope.get("rope_type") if isinstance(rope, dict) else None,
        "kv_cache_dtype": str(config.cache_config.cache_dtype),
        "mamba_ssm_cache_dtype": str(config.cache_config.mamba_ssm_cache_dtype),
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "speculative": None
        if spec is None
        else {
            "method": spec.method,
            "num_speculative_tokens": spec.num_speculative_tokens,
            "draft_architecture": spec.draft_model_config.architecture
            if spec.draft_model_config is not None
            else None,
        },
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "device_type": str(config.device_config.device_type),
        "parallel": {
            name: getattr(config.parallel_config, name, None)
            for name in (
                "tensor_parallel_size",
                "world_size",
                "nnodes",
                "node_rank",
                "master_addr",
                "master_port",
                "distributed_executor_backend",
            )
        },  # fmt: skip
    }


def main() -> int:
    request = json.loads(Path(sys.argv[1]).read_text())
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    flags = {}
    for action in parser._actions:
        for option in action.option_strings:
            flags[option] = action.nargs != 0
    results = {name: check(parser, case) for name, case in request["cases"].items()}
    Path(sys.argv[2]).write_text(json.dumps({"flags": flags, "cases": results}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
