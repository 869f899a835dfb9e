"""The patched PLE layer under captured CUDA graphs, against stock vLLM, with host-side timings.

Usage: python gpu_graph_check.py {cuda|cpu} RENDERED_DIR RESULT_JSON SNAPSHOT=TABLE_DIR

With the rendered patch files laid over the package and a packed table built from SNAPSHOT:
1. the vLLM config as a Qwen4Exp server resolves it (no --engram-config: EngramConfig(), the
   pinned-host backend), validated by VllmConfig itself;
2. stock vLLM's pinned-host n-gram embedding and the patched one, from the same checkpoint
   (inside `with torch.device("cuda")`, as vLLM builds them), and vLLM's own
   Qwen4ExpModelState;
3. after vLLM's prepare_dummy_inputs, one CUDA graph of the PLE lookup and decode per captured
   step size (1, 8, 16 tokens); then replays whose inputs vLLM's prepare_inputs prepared (the
   host step gathers and uploads the rows): every replay equals stock vLLM's lookup of the same
   step, consecutive replays see different rows, a replay after a dummy step (zero rows) is
   zeros, and the next real step is right again;
4. every step kind once more (a decode token, 8 of them, 4 requests x 4 MTP tokens, a
   2,048-token prompt chunk): its rows equal stock's, and the host step waits for the device
   once where the step has tokens only the device has (each request's prompt is 2,048 tokens:
   later positions are sampled tokens and drafts), never for a prompt chunk alone;
5. the host side of a step (from the end of the previous step's GPU work to the launch of the
   forward: prepare_inputs with the whole host step, and filling the graph's inputs), the
   launch and the step to its end, for 1, 8, 16 (4 requests x 4 MTP tokens) and 2,048 tokens,
   cold (table pages evicted and the prefetcher's memory of advised pages forgotten, before
   every repetition) and warm, for the graph and the eager forward; and which of them each
   cudagraph mode of vLLM 0.33 runs for that step.

The pinned-host layer needs vLLM's compiled ops (vllm._C: the serving image has them, the
wheel's Python sources do not); without them the stock reference is vLLM's device backend
(the same Triton lookup on the device), and the result names the backend it compared with.

`cpu` is the smoke mode of `make test`: it builds every config and object the CUDA run builds
up to the first CUDA call (the pinned-host layer's first act is a pinned allocation; on the CPU
the stock reference is vLLM's device backend, compared in its CUDA kernel's arithmetic order),
runs the same steps with the eager forward in place of each replay, once, and checks them the
same way.
Writes the figures and a short summary to RESULT_JSON; exit 1 when a check fails.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from harness.ple_layer import (
    DEVICE,
    MAX_REQS,
    NGRAM_MODULE,
    PLE_DECODER_LAYER,
    build,
    forward,
    model_state,
    patched_modules,
    seed_loader_filter,
    stock_rows,
    vllm_context,
)
from harness.ple_steps import Runner

CUDA = DEVICE.type == "cuda"
MAX_TOKENS = 2048
MAX_MODEL_LEN = 8192
REPLAYS = 6
REPEATS = 5 if CUDA else 1
# vLLM 0.33's cudagraph modes for this model, and what each runs a step with.
CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE", "NONE")
# vLLM's largest captured size by default: min(max_num_seqs x (1 + MTP tokens) x 2, 512)
# (config/vllm.py), for these 8 requests and 3 MTP tokens; larger steps run eager.
CAPTURE_MAX = min(MAX_REQS * 4 * 2, 512)
# Each request's prompt: positions past it hold what the sampler produced, which only the
# device has (a decode step's token, MTP drafts), as in serving.
PROMPT_LEN = 2048
# Timed step shapes: tokens -> (request id, tokens computed before, tokens this step) per
# request, whether the step is a uniform decode (what FULL graphs are captured for), and how
# many of each request's tokens are MTP drafts (the last ones).
SHAPES: dict[int, tuple[list[tuple[str, int, int]], bool, dict[str, int] | None]] = {
    1: ([("r0", 4000, 1)], True, None),
    8: ([(f"r{r}", 4000, 1) for r in range(8)], True, None),
    16: ([(f"r{r}", 4000, 4) for r in range(4)], True, {f"r{r}": 3 for r in range(4)}),
    2048: ([("r1", 0, PROMPT_LEN)], False, None),
}
GRAPH_SIZES = tuple(tokens for tokens in SHAPES if tokens <= CAPTURE_MAX)


def mode_runs(mode: str, tokens: int, uniform_decode: bool) -> str:
    """What a cudagraph mode runs a step with: full, piecewise (graphs) or eager.

    For one PLE layer a piecewise graph is the same capture as a full one (there is no
    attention to split the forward at), so the figures of both come from one graph.
    """
    if mode == "NONE" or tokens > CAPTURE_MAX:
        return "eager"
    if mode == "PIECEWISE":
        return "piecewise"
    if uniform_decode:
        return "full"
    return "piecewise" if mode == "FULL_AND_PIECEWISE" else "eager"


def resolve_engram_config() -> str:
    """The Engram config vLLM resolves for a Qwen4Exp model without --engram-config.

    VllmConfig validates an explicit EngramConfig against its model config; these checks
    build no ModelConfig (it would load the HF config and the model class), so the config is
    validated without one and then given what `_resolve_and_verify_engram_config` gives a
    model with PLE layers: EngramConfig() (cpu_offload=True), resolved against the parallel
    config the same way.
    """
    from vllm.config import EngramConfig, get_current_vllm_config

    config = get_current_vllm_config()
    engram = EngramConfig()
    engram.resolve_dp_shared_memory(config.parallel_config)
    engram.verify_parallel_config(config.parallel_config)
    config.engram_config = engram
    return str(engram)


def pinned_host_available() -> bool:
    """Whether stock vLLM's pinned-host backend can run: its UVA view of host memory is one of
    vLLM's compiled ops (vllm._C, in an installed vLLM such as the serving image's; the
    wheel's Python sources alone lack it, and the device backend is the stock reference)."""
    if not CUDA:
        return False  # its first act is a pinned allocation
    try:
        torch.ops._C.get_cuda_view_from_cpu_tensor  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def synchronize() -> None:
    if CUDA:
        torch.cuda.synchronize()


class Graphs:
    """One captured PLE forward per step size, reading the model state's input buffers."""

    def __init__(self, layer, state, sizes: tuple[int, ...]) -> None:
        self.layer = layer
        self.ids = torch.zeros(MAX_TOKENS, dtype=torch.int32, device=DEVICE)
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        for tokens in sizes:
            dummy = state.prepare_dummy_inputs(min(tokens, MAX_REQS), tokens)
            self.qsl, self.ctx = dummy["query_start_loc"], dummy["ngram_context"]
            if CUDA:
                self._capture(tokens)

    def _forward(self, tokens: int) -> torch.Tensor:
        return forward(self.layer, self.ids[:tokens], self.qsl, self.ctx)

    def eager(self, tokens: int) -> torch.Tensor:
        """The eager forward on the graphs' inputs (a step above the largest capture)."""
        return self._forward(tokens)

    def _capture(self, tokens: int) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self._forward(tokens)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.outputs[tokens] = self._forward(tokens)
        self.graphs[tokens] = graph

    def fill(self, input_ids: torch.Tensor, qsl: torch.Tensor, ctx: torch.Tensor) -> None:
        """The step's inputs into the graph's: prepare_inputs filled qsl and ctx in place."""
        if qsl.data_ptr() != self.qsl.data_ptr() or ctx.data_ptr() != self.ctx.data_ptr():
            raise RuntimeError("prepare_inputs returned other buffers than the captured ones")
        self.ids[: input_ids.shape[0]].copy_(input_ids)

    def run(self, tokens: int) -> torch.Tensor:
        """A replay of the graph of this size (the eager forward on the CPU)."""
        if not CUDA:
            return self._forward(tokens)
        self.graphs[tokens].replay()
        return self.outputs[tokens]


def replay_checks(runner: Runner, graphs: Graphs, stock, dtype) -> dict:
    """Replays of steps the host step prepared, each against stock vLLM's lookup."""
    checks: dict = {"replays": []}
    tokens, real_reqs = 8, 5  # a padded decode batch: 5 requests, 3 padding tokens
    previous: torch.Tensor | None = None
    for step in range(REPLAYS):
        scheduled = [(f"r{r}", PROMPT_LEN + 100 * step + r, 1) for r in range(real_reqs)]
        input_ids, qsl, ctx, real = runner.step(scheduled, pad_tokens=tokens - real_reqs)
        graphs.fill(input_ids, qsl, ctx)
        out = graphs.run(tokens)
        synchronize()
        theirs = stock_rows(stock, input_ids, qsl, ctx, dtype)
        checks["replays"].append(
            {
                "equals_stock": bool(torch.equal(out[:real], theirs[:real])),
                "nonzero": bool(out[:real].abs().sum() > 0),
                "padding_zero": bool((out[real:] == 0).all()),
                "differs_from_previous": previous is None or not torch.equal(out[:real], previous),
            }
        )
        previous = out[:real].clone()
    # a dummy step (profile, warm-up, DP idle) after real rows: the graph must replay zeros
    input_ids, qsl, ctx, _ = runner.step([("r0", 0, 4), ("r1", 0, 4)], dummy=True)
    graphs.fill(input_ids, qsl, ctx)
    out = graphs.run(tokens)
    synchronize()
    checks["zero_rows_replay_zero"] = bool((out == 0).all())
    # every step kind, a real step after the zeros: a captured size replays, a larger one runs
    # eagerly; its rows equal stock's, and it waits for the device once exactly when it has
    # tokens only the device has (decode tokens, drafts), never for prompt tokens alone
    checks["sizes"] = {}
    checks["syncs"] = {}
    host_step = runner.state.model._sparkple_host_step
    for size, (scheduled, _, drafts) in SHAPES.items():
        input_ids, qsl, ctx, real = runner.step(scheduled, drafts=drafts)
        synced = host_step.last_synced
        graphs.fill(input_ids, qsl, ctx)
        out = graphs.run(size) if size in GRAPH_SIZES else graphs.eager(size)
        synchronize()
        theirs = stock_rows(stock, input_ids, qsl, ctx, dtype)
        checks["sizes"][str(size)] = bool(
            torch.equal(out[:real], theirs[:real]) and out[:real].abs().sum() > 0
        )
        device_tokens = any(computed + count > PROMPT_LEN for _, computed, count in scheduled)
        checks["syncs"][str(size)] = {"synced": synced, "expected": device_tokens}
    return checks


def make_cold(embedding) -> None:
    """Every cold repetition starts alike: no table page cached, none remembered as advised."""
    embedding.table.evict()
    prefetcher = embedding._worker.prefetcher
    if prefetcher is not None:
        prefetcher.forget()


def time_step(
    runner: Runner,
    embedding,
    scheduled,
    launch: Callable[[int], torch.Tensor] | None,
    fill: Callable | None,
    *,
    cold: bool,
    drafts: dict[str, int] | None = None,
) -> dict:
    """Medians over REPEATS of one step shape, each from an idle device.

    host_side_ms: from the end of the previous step's GPU work to the launch of the forward
    (prepare_inputs with the whole host step, then filling the graph's inputs); of which
    gather_wait_ms the wait for the gather; launch_ms the replay or eager forward call;
    step_ms the host side, the launch and the device work to its end.
    """
    host, waits, launches, steps = [], [], [], []
    for _ in range(REPEATS):
        if cold:
            make_cold(embedding)
        before = embedding._stats.snapshot()["handshake_wait_seconds"]["sum"]
        synchronize()
        started = time.perf_counter()
        input_ids, qsl, ctx, _ = runner.step(scheduled, drafts=drafts)
        if fill is not None:
            fill(input_ids, qsl, ctx)
        launched = time.perf_counter()
        if launch is not None:
            launch(input_ids.shape[0])
        returned = time.perf_counter()
        synchronize()
        ended = time.perf_counter()
        host.append(launched - started)
        launches.append(returned - launched)
        steps.append(ended - started)
        waits.append(embedding._stats.snapshot()["handshake_wait_seconds"]["sum"] - before)

    def ms(values: list[float]) -> float:
        return round(statistics.median(values) * 1e3, 3)

    return {
        "host_side_ms": ms(host),
        "gather_wait_ms": ms(waits),
        "launch_ms": ms(launches),
        "step_ms": ms(steps),
    }


def timings(runner: Runner, embedding, layer, graphs: Graphs) -> dict:
    """Each shape cold and warm, graph and eager, and what each cudagraph mode runs."""
    figures = {}
    for tokens, (scheduled, uniform, drafts) in SHAPES.items():
        by_execution = {}
        runs = {"eager": (graphs.eager, graphs.fill)}
        if tokens in GRAPH_SIZES:
            runs["graph"] = (graphs.run, graphs.fill)
        for execution, (launch, fill) in runs.items():
            by_execution[execution] = {
                temperature: time_step(
                    runner,
                    embedding,
                    scheduled,
                    launch,
                    fill,
                    cold=temperature == "cold",
                    drafts=drafts,
                )
                for temperature in ("cold", "warm")
            }
        modes = {mode: mode_runs(mode, tokens, uniform) for mode in CUDAGRAPH_MODES}
        figures[str(tokens)] = {
            "uniform_decode": uniform,
            "modes": modes,
            "by_execution": by_execution,
        }
    return figures


def summary(result: dict) -> list[str]:
    lines = [
        f"graph check ({result['device']}): stock {result['stock_backend']}, "
        f"patched {result['patched_backend']}; "
        + ("" if CUDA else "graph replays run eagerly; ")
        + ("all checks passed" if result["ok"] else "FAILED: " + ", ".join(result["failed"]))
    ]
    for tokens, shape in result["host_side"].items():
        for execution, temps in shape["by_execution"].items():
            eager = execution == "eager"
            modes = [m for m, runs in shape["modes"].items() if (runs == "eager") == eager]
            lines.append(
                f"  {tokens:>4} tokens {execution:<5} ({', '.join(modes) or 'no mode'}): host side "
                f"cold {temps['cold']['host_side_ms']} ms (gather wait "
                f"{temps['cold']['gather_wait_ms']}), warm {temps['warm']['host_side_ms']} ms; "
                f"step warm {temps['warm']['step_ms']} ms"
            )
    return lines


def failed_checks(result: dict) -> list[str]:
    checks = result["checks"]
    failed = []
    for i, replay in enumerate(checks["replays"]):
        failed += [f"replay {i} {name}" for name, ok in replay.items() if not ok]
    if not checks["zero_rows_replay_zero"]:
        failed.append("a replay after a dummy step is not zeros")
    failed += [f"{size}-token step's rows" for size, ok in checks["sizes"].items() if not ok]
    failed += [
        f"{size}-token step {'did not wait' if sync['expected'] else 'waited'} for the device"
        for size, sync in checks["syncs"].items()
        if sync["synced"] != sync["expected"]
    ]
    if CUDA and not (result["staging_pinned"] and result["host_inputs_pinned"]):
        failed.append("host buffers not pinned")
    return failed


def main() -> int:
    from transformers import Qwen4ExpTextConfig

    rendered, result_path = Path(sys.argv[2]), Path(sys.argv[3])
    snapshot, table_dir = map(Path, sys.argv[4].split("=", 1))
    raw = json.loads((snapshot / "config.json").read_text())
    config = Qwen4ExpTextConfig(**raw["text_config"])
    prefix = f"model.language_model.layers.{PLE_DECODER_LAYER}.ple.ple_embedding."
    vocab, eos = int(config.vocab_size), int(config.eos_token_id)
    dtype = torch.bfloat16
    seed_loader_filter(rendered)
    result: dict = {
        "device": torch.cuda.get_device_name() if CUDA else "cpu (smoke mode)",
        "capture_max": CAPTURE_MAX,
    }
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory() as work,
        vllm_context(Path(work), MAX_TOKENS, MAX_MODEL_LEN),
    ):
        result["engram_config"] = resolve_engram_config()
        stock_module = importlib.import_module(NGRAM_MODULE)
        patched, state_module = patched_modules(rendered)
        os.environ.pop("SPARKPLE_PLE_TABLE_DIR", None)
        if not pinned_host_available():
            from vllm.config import get_current_vllm_config

            get_current_vllm_config().engram_config.cpu_offload = False
        stock, _ = build(stock_module, config, snapshot, prefix, dtype, MAX_TOKENS)
        result["stock_backend"] = type(stock.ngram_embedding).__name__
        os.environ["SPARKPLE_PLE_TABLE_DIR"] = str(table_dir)
        layer, _ = build(patched, config, snapshot, prefix, dtype, MAX_TOKENS)
        embedding = layer.ngram_embedding
        result["patched_backend"] = type(embedding).__name__
        result["staging_pinned"] = bool(embedding._worker._pinned is not None)
        result["host_inputs_pinned"] = all(t.is_pinned() for t in embedding._inputs.all)
        state = model_state(state_module, torch.nn.ModuleList([layer]), config)
        runner = Runner(state, MAX_MODEL_LEN)
        rng = np.random.default_rng(5)
        for r in range(MAX_REQS):
            tokens = rng.integers(0, vocab, size=MAX_MODEL_LEN)
            tokens[rng.random(MAX_MODEL_LEN) < 0.05] = eos
            runner.add(f"r{r}", tokens, PROMPT_LEN)
        graphs = Graphs(layer, state, GRAPH_SIZES)
        result["checks"] = replay_checks(runner, graphs, stock, dtype)
        result["host_side"] = timings(runner, embedding, layer, graphs)
        embedding.close()
    result["seconds"] = round(time.monotonic() - started, 1)
    result["failed"] = failed_checks(result)
    result["ok"] = not result["failed"]
    result["summary"] = summary(result)
    result_path.write_text(json.dumps(result, indent=2))
    print("\n".join(result["summary"]))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
