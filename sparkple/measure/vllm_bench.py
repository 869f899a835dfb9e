"""Run vLLM's own serving benchmark (`vllm bench serve`) for each case of a plan, in one process.

Usage: python -m sparkple.measure.vllm_bench PLAN.json

Runs with a Python that has vLLM (the serving image's, with the package on PYTHONPATH as every
helper container has it; in the lab, the vLLM test venv) and imports nothing else of sparkple's,
so it runs on whatever Python the image has. One process for every case: importing vLLM's
benchmark takes longer than a short case. Each case is vLLM's `benchmarks.serve.main_async` with
the arguments `vllm bench serve` would parse, bounded by its number of prompts and by
`case_timeout_s`. The result of each case (vLLM's result JSON without its per-request lists) is
written to OUT_DIR/<workload>-c<concurrency>.json, and one line per case is printed.

PLAN.json:
  base_url, model, tokenizer, out_dir, case_timeout_s (seconds), seed
  cases: [{workload, dataset ("sharegpt" or "random"), path (sharegpt), input_len (random),
           output_len, concurrency, num_prompts}]
The API key, if the server wants one, comes from OPENAI_API_KEY (where vLLM's benchmark
reads it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

# vLLM's per-request lists: long, and not what a summary compares
# (--save-detailed keeps them in the result: the errors say why a request failed)
PER_REQUEST = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors",
               "start_times", "latencies", "queue_times", "server_queue_times",
               "server_ttfts")  # fmt: skip


def case_argv(plan: dict[str, Any], case: dict[str, Any]) -> list[str]:
    """The `vllm bench serve` arguments of one case."""
    argv = [
        "--backend", "openai", "--endpoint", "/v1/completions",
        "--base-url", plan["base_url"], "--model", plan["model"],
        "--tokenizer", plan["tokenizer"], "--seed", str(plan.get("seed", 0)),
        "--dataset-name", case["dataset"], "--num-prompts", str(case["num_prompts"]),
        "--max-concurrency", str(case["concurrency"]), "--request-rate", "inf",
        "--output-len", str(case["output_len"]), "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--disable-tqdm", "--save-detailed",
    ]  # fmt: skip
    if case["dataset"] == "sharegpt":
        argv += ["--dataset-path", case["path"]]
    else:
        argv += ["--input-len", str(case["input_len"]), "--random-range-ratio", "0"]
    return argv


async def run_case(serve: Any, args: argparse.Namespace, timeout_s: float) -> dict[str, Any]:
    return await asyncio.wait_for(serve.main_async(args), timeout_s)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    plan = json.loads(Path(argv[0]).read_text())
    from vllm.benchmarks import serve  # slow: once, after the plan is known to be readable

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser as Parser
    except ImportError:  # the parser vLLM's CLI uses; a plain one takes the same flags
        Parser = argparse.ArgumentParser  # noqa: N806
    out = Path(plan["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for case in plan["cases"]:
        parser = Parser()
        serve.add_cli_args(parser)
        args = parser.parse_args(case_argv(plan, case))
        name = f"{case['workload']}-c{case['concurrency']}"
        try:
            result = asyncio.run(run_case(serve, args, float(plan["case_timeout_s"])))
        except TimeoutError:
            print(f"bench: {name}: no result within {plan['case_timeout_s']} s", flush=True)
            failed += 1
            continue
        except Exception as exc:  # vLLM's benchmark raises when its first request fails
            print(f"bench: {name}: failed: {type(exc).__name__}: {exc}", flush=True)
            failed += 1
            continue
        summary = {k: v for k, v in result.items() if k not in PER_REQUEST}
        summary["workload"], summary["concurrency"] = case["workload"], case["concurrency"]
        (out / f"{name}.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
        print(
            f"bench: {name}: {summary.get('completed', 0)}/{case['num_prompts']} requests, "
            f"{summary.get('output_throughput', 0.0):.1f} output tok/s, "
            f"TTFT p50 {summary.get('p50_ttft_ms', 0.0):.1f} ms",
            flush=True,
        )
        if summary.get("completed", 0) < case["num_prompts"]:
            failed += 1
            # why: the distinct errors of the requests that failed (vLLM keeps a traceback:
            # its last line, the exception), each cut short
            errors = {e.strip().splitlines()[-1][:300] for e in result.get("errors") or [] if e}
            for error in sorted(errors):
                print(f"bench: {name}: a request failed: {error}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
