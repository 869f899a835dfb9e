"""Greedy tokens and top-k logprobs from vLLM's own `LLM(...)`, run in the vLLM test venv by
harness/engine.py (which lays the tree and sets the environment).

    python engine_run.py SPEC_JSON RESULT_JSON

The spec: {"logprobs": K, "runs": [RUN, ...]}; a RUN: {"name", "model" (a snapshot),
"table" (a packed table directory, or null: vLLM's own PLE backend), "engine" (more LLM
arguments), "batches": [[REQUEST, ...], ...]}; a REQUEST: {"id", "prompt" (token ids),
"max_tokens"}. The runs go one after another in this process (one import of vLLM); a run's
batches go one after another into its engine, a batch's requests all at once (`generate`).
Sampling is greedy, EOS ignored, no tokenizer (prompts are token ids). With
"probe_async_scheduling": MODEL the spec also asks what vLLM resolves `async_scheduling=True` to.

The result: {"import_s", "runs": {NAME: {"outputs": {ID: {"tokens", "logprobs" (per step:
[[token, logprob], ...] by rank), "num_cached_tokens"}}, "backends" (the PLE embedding
classes the model holds), "counters" (the packed table's PLE counters, summed), "config" (what
the engine resolved: chunked prefill, its token budget, prefix caching, async scheduling), "up_s",
"generate_s", "peak_rss_kib"}}}.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

TABLE_ENV = "SPARKPLE_PLE_TABLE_DIR"
# What every run's engine is: the whole model's language half, eager (no graphs on a CPU),
# safetensors, no tokenizer, in this process.
ENGINE_ARGS: dict[str, Any] = {
    "language_model_only": True,
    "enforce_eager": True,
    "load_format": "safetensors",
    "skip_tokenizer_init": True,
    "dtype": "bfloat16",
    "seed": 0,
    "max_model_len": 512,
    "distributed_executor_backend": "uni",
}


def model_report(model: Any) -> dict[str, Any]:
    """The PLE embedding classes a model holds and the packed table's counters (summed)."""
    backends = sorted(
        {type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Qwen4ExpPLE")}
    )
    counters: dict[str, int] = {}
    for module in model.modules():
        stats = getattr(module, "_stats", None)
        if stats is not None and hasattr(stats, "snapshot"):
            for name, value in stats.snapshot()["counters"].items():
                counters[name] = counters.get(name, 0) + int(value)
    return {"backends": backends, "counters": counters}


def run(spec_run: dict[str, Any], logprobs: int) -> dict[str, Any]:
    from vllm.entrypoints.llm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams

    table = spec_run.get("table")
    if table:
        os.environ[TABLE_ENV] = str(table)
    else:
        os.environ.pop(TABLE_ENV, None)
    args = dict(ENGINE_ARGS)
    if not table:  # vLLM's own backend: the table resident, not pinned (no pinned memory here)
        args["engram_config"] = {"cpu_offload": False}
    args.update(spec_run.get("engine", {}))
    started = time.monotonic()
    llm = LLM(model=spec_run["model"], **args)
    up_s = time.monotonic() - started
    config = llm.llm_engine.vllm_config
    resolved = {
        "enable_chunked_prefill": bool(config.scheduler_config.enable_chunked_prefill),
        "max_num_batched_tokens": int(config.scheduler_config.max_num_batched_tokens),
        "enable_prefix_caching": bool(config.cache_config.enable_prefix_caching),
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "mamba_cache_mode": str(getattr(config.cache_config, "mamba_cache_mode", None)),
    }
    outputs: dict[str, Any] = {}
    started = time.monotonic()
    for batch in spec_run["batches"]:
        prompts = [TokensPrompt(prompt_token_ids=list(r["prompt"])) for r in batch]
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=int(r["max_tokens"]),
                logprobs=logprobs,
                ignore_eos=True,
                detokenize=False,
            )
            for r in batch
        ]
        for request, result in zip(
            batch, llm.generate(prompts, params, use_tqdm=False), strict=True
        ):
            completion = result.outputs[0]
            steps = []
            for step in completion.logprobs or []:
                ranked = sorted(step.items(), key=lambda kv: (kv[1].rank, kv[0]))
                steps.append([[int(token), float(lp.logprob)] for token, lp in ranked])
            outputs[request["id"]] = {
                "tokens": [int(t) for t in completion.token_ids],
                "logprobs": steps,
                "num_cached_tokens": int(result.num_cached_tokens or 0),
            }
    generate_s = time.monotonic() - started
    (report,) = llm.apply_model(model_report)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    return {
        "outputs": outputs,
        **report,
        "config": resolved,
        "up_s": up_s,
        "generate_s": generate_s,
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


def probe_async_scheduling(model: str) -> dict[str, Any]:
    """What vLLM makes of `async_scheduling=True` for `model` on this platform (the engine's
    config only, no engine): the value it resolved, or the error it refused it with."""
    from vllm.engine.arg_utils import EngineArgs

    args = {**ENGINE_ARGS, "engram_config": {"cpu_offload": False}, "async_scheduling": True}
    try:
        config = EngineArgs(model=model, **args).create_engine_config()
    except Exception as exc:  # the refusal is the finding
        return {"resolved": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"resolved": bool(config.scheduler_config.async_scheduling), "error": None}


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    started = time.monotonic()
    import vllm  # noqa: F401 (what the first run would import: timed apart)

    result: dict[str, Any] = {"import_s": time.monotonic() - started, "runs": {}}
    if spec.get("probe_async_scheduling"):
        result["async_scheduling"] = probe_async_scheduling(spec["probe_async_scheduling"])
    for spec_run in spec["runs"]:
        result["runs"][spec_run["name"]] = run(spec_run, int(spec.get("logprobs", 3)))
    Path(sys.argv[2]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
