"""vLLM 0.34's own disk offload against sparkple's packed table on a GPU, per step kind, in one
run: the host side and the whole step (host step, then the PLE forward replayed from a CUDA
graph), medians, and the ratio sparkple / 0.34.

Usage: python gpu_disk_offload.py {cuda|cpu|--cpu-smoke} RENDERED_DIR RESULT_JSON SNAPSHOT=TABLE_DIR

Runs in the vLLM venv with the rendered patch laid over the package, as gpu_host_split.py does.
Arms, each through vLLM's own model state (harness/ple_steps.Runner), on the same tokens:
- 0.34: `Qwen4ExpPLEDiskOffloadEmbedding` from vLLM's own module, loaded from the checkpoint's
  shard files as vLLM loads it; its model state stages the rows (`stage_checkpoint_rows`: the ids
  hashed on the device, copied to pinned memory, a stream sync, one preadv per distinct row and
  plane, the copy into the staging planes the graph reads); its forward is `staged_rows`;
- sparkple: the rendered patch's packed-table layer and host step; its forward is
  `finalize_prefetch` (the fused decode of the device buffer).
Step kinds: decode at 1 and 8 requests, MTP 4 requests x 4 tokens, a prompt chunk; the page
cache is warm (the table and checkpoint were just written). Host side: 0.34's stage_rows (after
its sync), sparkple's host step after its copy of the device's tokens is in (from its start
where it needs none): bench/disk_offload_compare.py's measure. Whole step: from the model
state's prepare_inputs to the replayed forward done (the device idle at the start). Every step's
staged packed rows are compared byte for byte between the arms (`ok`), and their decoded rows.

cpu (or --cpu-smoke) runs the same steps small, with the forwards eager (no graph; 0.34's NVFP4
decode is a Triton kernel, decoded here in its order, harness.ple_layer.kernel_order_decode):
make test runs it, so the GPU run cannot fail on set-up code nobody ran.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SMOKE = sys.argv[1] in ("cpu", "--cpu-smoke")
if SMOKE:
    sys.argv[1] = "cpu"  # harness.ple_layer reads its device from argv[1]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import harness.ple_layer as ple  # noqa: E402
from harness.ple_steps import Runner  # noqa: E402

CHUNK = 128 if SMOKE else 2048
REPEATS = 2 if SMOKE else 12
# (requests, tokens a request per step, drafts a request per step)
KINDS = {
    "decode@1": (1, 1, 0),
    "decode@8": (8, 1, 0),
    "mtp 4x4": (4, 4, 3),
    "prompt chunk": (1, CHUNK, 0),
}
PROMPT = 3  # a decoding request's prompt, prefilled before the timed steps
MAX_MODEL_LEN = CHUNK * (REPEATS + 2) + 64
CUDA = ple.DEVICE.type == "cuda"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


class Arm:
    """One layer, its model state and runner, its timed host side and its forward."""

    def __init__(self, name: str, layer, state_module, config) -> None:
        self.name = name
        self.layer = layer
        self.embedding = layer.ngram_embedding
        self.model = torch.nn.ModuleList([layer])
        self.state_module = state_module
        self.config = config
        self.host_s: list[float] = []
        self.started = 0.0
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        if name == "0.34":
            stage_rows = self.embedding.stage_rows

            def timed(num_tokens: int) -> None:
                t0 = time.perf_counter()
                stage_rows(num_tokens)
                self.host_s.append(time.perf_counter() - t0)

            self.embedding.stage_rows = timed  # what stage_checkpoint_rows calls
            self.host = None
        else:
            self.host = importlib.import_module("sparkple.vllm.host_step").host_step_of(self.model)

    def runner(self) -> Runner:
        state = ple.model_state(self.state_module, self.model, self.config)
        if self.name == "0.34":
            assert state.disk_offload_modules, "vLLM's model state found no disk offload layer"
        prepare = state.prepare_inputs

        def timed_prepare(*args, **kwargs):
            self.started = time.perf_counter()
            return prepare(*args, **kwargs)

        state.prepare_inputs = timed_prepare
        return Runner(state, MAX_MODEL_LEN)

    def host_side(self) -> float:
        if self.host is None:
            return self.host_s[-1]
        before, _, after = self.host.last_times
        return after if self.host.last_synced else before + after

    def forward(self, tokens: int) -> torch.Tensor:
        """The PLE layer's rows of the step, as the forward reads them (decoded)."""
        if self.host is not None:
            return ple.in_forward(self.embedding, tokens)
        if CUDA:
            return self.embedding.staged_rows(tokens)
        codes, scales = self.planes(tokens)
        rows = ple.kernel_order_decode(
            codes.flatten(0, 1), scales.flatten(0, 1), self.embedding.weight_scale_2, tokens
        )
        return rows.to(self.embedding.params_dtype)

    def planes(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scales = (staging[:tokens] for staging, _, _ in self.embedding._planes.values())
        return codes, scales

    def staged(self, tokens: int) -> torch.Tensor:
        """The step's staged packed rows, uint8 [tokens, heads, 90] (codes, then scales)."""
        if self.host is not None:
            return self.embedding.packed_rows[:tokens]
        codes, scales = self.planes(tokens)
        return torch.cat([codes.view(torch.uint8), scales.view(torch.uint8)], dim=-1)

    def replay(self, tokens: int) -> torch.Tensor:
        """The forward for `tokens` tokens replayed from its CUDA graph (captured at its first
        use, after a warm-up on a side stream); eager on the CPU."""
        if not CUDA:
            return self.forward(tokens)
        if tokens not in self.graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.forward(tokens)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self.forward(tokens)
            self.graphs[tokens] = (graph, out)
        graph, out = self.graphs[tokens]
        graph.replay()
        return out


# (scheduled: (request, tokens computed before, tokens this step), drafts per request)
Step = tuple[list[tuple[str, int, int]], dict[str, int] | None]


def stream(kind: str, vocab: int, seed: int):
    """(requests: name -> (tokens, prompt length), setup steps, steps) of a step kind."""
    reqs, per_step, drafts = KINDS[kind]
    rng = np.random.default_rng(seed)
    if kind == "prompt chunk":
        prompt = CHUNK * (REPEATS + 1)
        requests = {"p": (rng.integers(0, vocab, prompt + 8), prompt)}
        chunks: list[Step] = [([("p", CHUNK * n, CHUNK)], None) for n in range(REPEATS + 1)]
        return requests, [], chunks
    requests = {
        f"r{i}": (rng.integers(0, vocab, PROMPT + (REPEATS + 1) * per_step + 8), PROMPT)
        for i in range(reqs)
    }
    setup = [[(name, 0, PROMPT) for name in requests]]
    steps: list[Step] = [
        (
            [(name, PROMPT + n * per_step, per_step) for name in requests],
            {name: drafts for name in requests} if drafts else None,
        )
        for n in range(REPEATS + 1)
    ]
    return requests, setup, steps


def run_kind(kind: str, arms: list[Arm], vocab: int) -> dict[str, Any]:
    """The kind's steps, the arms alternating step by step on the same tokens; the first step
    of each arm captures its graph and is not timed."""
    requests, setup, steps = stream(kind, vocab, seed=len(kind))
    runners = {arm.name: arm.runner() for arm in arms}
    for arm in arms:
        for name, (tokens, prompt_len) in requests.items():
            runners[arm.name].add(name, tokens, prompt_len)
        for scheduled in setup:
            runners[arm.name].step(scheduled)
    host: dict[str, list[float]] = {arm.name: [] for arm in arms}
    whole: dict[str, list[float]] = {arm.name: [] for arm in arms}
    staged_equal, decoded_equal = [], []
    for n, (scheduled, drafts) in enumerate(steps):
        order = arms if n % 2 else arms[::-1]
        outs, staged = {}, {}
        for arm in order:
            sync()
            runners[arm.name].step(scheduled, drafts=drafts)
            tokens = sum(count for _, _, count in scheduled)
            out = arm.replay(tokens)
            sync()
            done = time.perf_counter()
            if n:
                host[arm.name].append(arm.host_side())
                whole[arm.name].append(done - arm.started)
            outs[arm.name] = out.clone()
            staged[arm.name] = arm.staged(tokens).clone()
        base, ours = staged["0.34"], staged["sparkple"]
        staged_equal.append(bool(torch.equal(base, ours)) and bool(ours.any()))
        decoded_equal.append(bool(torch.equal(outs["0.34"], outs["sparkple"])))
    for arm in arms:
        for name in requests:
            runners[arm.name].remove(name)
    med = {
        arm.name: {
            "host_us": statistics.median(host[arm.name]) * 1e6,
            "whole_us": statistics.median(whole[arm.name]) * 1e6,
        }
        for arm in arms
    }
    return {
        "arms": med,
        "host_ratio": ratio(med["sparkple"]["host_us"], med["0.34"]["host_us"]),
        "whole_ratio": ratio(med["sparkple"]["whole_us"], med["0.34"]["whole_us"]),
        "steps": len(staged_equal),
        "staged_equal": all(staged_equal),
        "decoded_equal": all(decoded_equal),
    }


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def main() -> int:
    rendered, result_path = Path(sys.argv[2]), Path(sys.argv[3])
    snapshot, table_dir = (Path(p) for p in sys.argv[4].split("=", 1))
    from transformers import Qwen4ExpTextConfig

    raw = json.loads((snapshot / "config.json").read_text())
    config = Qwen4ExpTextConfig(**raw["text_config"])
    prefix = f"model.language_model.layers.{ple.PLE_DECODER_LAYER}.ple.ple_embedding."
    dtype = torch.bfloat16
    max_tokens = max(CHUNK, 16)
    ple.MAX_TOKENS = max_tokens
    ple.seed_loader_filter(rendered)
    result: dict[str, Any] = {"device": ple.DEVICE.type, "repeats": REPEATS, "kinds": {}}
    with (
        tempfile.TemporaryDirectory() as work,
        ple.vllm_context(Path(work), max_tokens=max_tokens, max_model_len=MAX_MODEL_LEN),
    ):
        stock_module = importlib.import_module(ple.NGRAM_MODULE)
        stock_state = importlib.import_module(ple.STATE_MODULE)
        os.environ.pop("SPARKPLE_PLE_TABLE_DIR", None)  # vLLM's own backend
        disk = ple.disk_offload_layer(stock_module, config, snapshot, prefix, dtype, max_tokens)
        if disk is None:
            result.update(ok=False, summary=["disk offload: this vLLM has none (0.34 needed)"])
            result_path.write_text(json.dumps(result, indent=2))
            return 1
        patched, state_module = ple.patched_modules(rendered)
        os.environ["SPARKPLE_PLE_TABLE_DIR"] = str(table_dir)
        layer, _ = ple.build(patched, config, snapshot, prefix, dtype, max_tokens)
        arms = [
            Arm("0.34", disk, stock_state, config),
            Arm("sparkple", layer, state_module, config),
        ]
        result["backends"] = [type(arm.embedding).__name__ for arm in arms]
        vocab = int(config.vocab_size)
        for kind in KINDS:
            result["kinds"][kind] = run_kind(kind, arms, vocab)
        layer.ngram_embedding.close()
    result["ok"], result["summary"] = verdict(result)
    result_path.write_text(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


def verdict(result: dict[str, Any]) -> tuple[bool, list[str]]:
    """Both arms staged the same bytes in every step of every kind."""
    kinds = result["kinds"]
    ok = all(k["staged_equal"] for k in kinds.values())
    graph = "graph replay" if result["device"] == "cuda" else "eager, no graph"
    lines = [
        f"disk offload, {name}: host {k['arms']['sparkple']['host_us']:.0f} us against "
        f"{k['arms']['0.34']['host_us']:.0f} us for vLLM 0.34's ({k['host_ratio']:.3f}x), whole "
        f"step ({graph}) {k['arms']['sparkple']['whole_us']:.0f} us against "
        f"{k['arms']['0.34']['whole_us']:.0f} us ({k['whole_ratio']:.3f}x)"
        + ("" if k["staged_equal"] else " WRONG ROWS")
        + ("" if k["decoded_equal"] else " (decoded rows differ)")
        for name, k in kinds.items()
    ]
    return ok, lines


if __name__ == "__main__":
    sys.exit(main())
