"""Run inside the vLLM test venv: stock vLLM PLE vs the patched packed-table backend.

Usage: python ple_equivalence.py DEVICE RENDERED_DIR RESULT_JSON SNAPSHOT=TABLE_DIR [...]

Builds vLLM 0.33.0's own `Qwen4ExpNGramEmbedding` from a synthetic checkpoint twice, loading
its weights through vLLM's own safetensors iterator: with the stock device backend (rows loaded
into a tensor), and with the rendered patch files laid over the package (as the bind mounts do
in the serving container) and SPARKPLE_PLE_TABLE_DIR naming the table built from the same
checkpoint. Each step runs as vLLM's V2 runner runs it: vLLM's own (patched)
`Qwen4ExpModelState.prepare_inputs` builds the PLE inputs from the request state and runs the
host step, then the forward reads the layer's device buffer. Writes what it observed, per
checkpoint quantization, to RESULT_JSON; the pytest side asserts on it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch

MAX_TOKENS = 512
PLE_DECODER_LAYER = 1  # ple_layer_ids [2] is one-based
# "cpu" (CI) or "cuda" (where vLLM's Triton kernels and the pinned-staging copy run)
DEVICE = torch.device(sys.argv[1])
NGRAM_MODULE = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
STATE_MODULE = "vllm.models.qwen4_exp.nvidia.model_state"
COMMON_MODULE = "vllm.models.qwen4_exp.common.ngram_embedding"
LOADER_FILTER = "vllm.model_executor.model_loader.ep_weight_filter"
MAX_REQS = 8
MAX_MODEL_LEN = 1024


@contextmanager
def vllm_context(
    workdir: Path,
    max_tokens: int = MAX_TOKENS,
    max_model_len: int = MAX_MODEL_LEN,
    cpu_offload: bool | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    init_file: Path | None = None,
) -> Iterator[None]:
    """The least of vLLM's setup these modules need: a config and its groups (gloo). With
    tp_size > 1 every rank's process calls this with its own tp_rank and the same init_file:
    vLLM's own set-up makes the TP group (and the PLE's embedding group, the same group)."""
    from vllm.config import (
        DeviceConfig,
        EngramConfig,
        LoadConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    config = VllmConfig(
        device_config=DeviceConfig(device=DEVICE.type),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
        # the serving recipe's loader: the only one that skips the row shards before reading
        load_config=LoadConfig(load_format="safetensors", safetensors_load_strategy="lazy"),
        scheduler_config=SchedulerConfig(
            max_num_seqs=MAX_REQS,
            max_num_batched_tokens=max_tokens,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
        # None: vLLM's device backend; True: its pinned-host backend (needs CUDA and UVA)
        engram_config=None if cpu_offload is None else EngramConfig(cpu_offload=cpu_offload),
    )
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=tp_size,
            rank=tp_rank,
            local_rank=tp_rank,
            distributed_init_method=f"file://{init_file or workdir / 'dist-init'}",
            backend="gloo",
        )
        initialize_model_parallel(tp_size, 1)
        yield


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def checkpoint_weights(snapshot: Path, prefix: str, peak: dict):
    """(name relative to the PLE module, tensor) pairs from vLLM's own safetensors iterator.

    It maps each file (the serving recipe's lazy strategy); a tensor's pages enter RSS only when
    something reads them. peak["rss"] records the most RSS grew while the loader held a tensor;
    peak["materialized"] lists the names the iterator read (it reads a tensor right before it
    yields it).
    """
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(path) for path in snapshot.glob("*.safetensors"))
    base = rss_bytes()
    peak["rss"] = 0
    peak["materialized"] = []
    for name, tensor in safetensors_weights_iterator(files, False, "lazy"):
        peak["materialized"].append(name)
        if name.startswith(prefix):
            yield name[len(prefix) :], tensor
            # the consumer is done with this tensor; it is still referenced here
            peak["rss"] = max(peak["rss"], rss_bytes() - base)


def build(module, config, snapshot: Path, prefix: str, dtype: torch.dtype, max_tokens=MAX_TOKENS):
    with DEVICE:
        layer = module.Qwen4ExpNGramEmbedding(
            config,
            int(config.ple_embed_dim),
            0,  # ple_dense_layer_id: the model's first (and only) PLE layer
            max_tokens,
            data_parallel_rank=0,
            prefix=prefix.rstrip("."),
            params_dtype=dtype,
        )
    peak: dict = {}
    loaded = layer.load_weights(checkpoint_weights(snapshot, prefix, peak))
    embedding = layer.ngram_embedding
    embedding.embedding_method.process_weights_after_loading(embedding)
    layer.load_rss_growth = peak["rss"]
    layer.materialized = peak["materialized"]
    return layer, loaded


def forward(layer, input_ids, query_start_loc, ngram_context) -> torch.Tensor:
    """The PLE module inside one forward, as the model runs it (prefetch one layer early)."""
    hidden = torch.empty(input_ids.shape[0], 0, device=DEVICE)
    layer.start_prefetch(input_ids, query_start_loc, ngram_context)
    rows = layer(hidden, input_ids, query_start_loc, ngram_context)
    # what vLLM's PLE layer does next: FP8 rows get their scale, NVFP4 rows are decoded already
    return layer.ngram_embedding.dequantize(rows, layer.ngram_embedding.params_dtype)


def model_state(state_module, model, text_config):
    """vLLM's own Qwen4ExpModelState from the (patched) wheel file, on this device.

    Its base classes' constructors build runner-wide state (RoPE, prompt embeddings, mamba
    bookkeeping) that needs a full model config; the Qwen4Exp class's own constructor,
    add_request, remove_request, prepare_inputs and prepare_dummy_inputs - the code the PLE
    inputs come from - run as shipped. The base constructor is replaced by the attributes
    those methods read (the mamba state's own add_request included).
    """
    from vllm.config import get_current_vllm_config
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

    current = get_current_vllm_config()
    config = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=text_config),
        scheduler_config=current.scheduler_config,
        parallel_config=current.parallel_config,
        cache_config=current.cache_config,
    )

    def base_init(self, vllm_config, model, encoder_cache, device):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.scheduler_config = vllm_config.scheduler_config
        self.cache_config = vllm_config.cache_config
        self.model = model
        self.device = device
        self.max_num_reqs = self.scheduler_config.max_num_seqs
        self.max_num_tokens = self.scheduler_config.max_num_batched_tokens
        self.supports_mm_inputs = False
        self.prompt_embeds_state = None
        self.rope_state = None  # 1D positions: the default state's prepare_inputs adds none
        self.num_accepted_tokens_gpu = torch.ones(self.max_num_reqs, dtype=torch.int32)
        self._align_mode = False
        self.recoverssm = None

    with mock.patch.object(MambaHybridModelState, "__init__", base_init):
        return state_module.Qwen4ExpModelState(config, model, None, DEVICE)


def request_states(max_model_len: int):
    """vLLM's own RequestState (request slots, prompt and prefill lengths, computed counts).

    On a CPU platform vLLM's UVA probe answers yes (`is_uva_available` is true for its CPU
    platform) but CPU torch has no pinned allocator, so the probe is answered as on a
    platform without pinned memory: vLLM's own explicit-copy buffers are used instead, on
    this device (the unspecified platform vLLM sees here names no device type).
    """
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.states import RequestState

    with (
        mock.patch.object(buffer_utils, "is_uva_available", lambda: False),
        mock.patch.object(type(current_platform), "device_type", DEVICE.type),
    ):
        return RequestState(
            MAX_REQS, max_model_len, MAX_TOKENS, 3, 1 << 20, DEVICE, use_dense_all_token_ids=True
        )


class Runner:
    """The V2 runner's side of a step, reduced to what the PLE inputs are built from, with
    vLLM's own classes: RequestState (each request's slot and tokens, how many are computed),
    NewRequestData handed to the model state's add_request, and the InputBatch of each step.

    Tokens of a request past its prompt are what the sampler produced (a decode token, or
    MTP drafts): the runner writes them into the step's input ids as vLLM's
    combine_sampled_and_draft_tokens does, and into all_token_ids once accepted.
    """

    def __init__(self, state, max_model_len: int = MAX_MODEL_LEN) -> None:
        self.state = state
        self.requests = request_states(max_model_len)
        self.tokens: dict[str, np.ndarray] = {}
        self.rng = np.random.default_rng(11)

    @property
    def req_id_to_index(self) -> dict[str, int]:
        return self.requests.req_id_to_index

    def add(self, req_id: str, tokens: np.ndarray, prompt_len: int | None = None) -> None:
        """A new request (the runner's add_requests): its prompt is tokens[:prompt_len]; the
        rest are the tokens it will generate."""
        from vllm.v1.core.sched.output import NewRequestData

        prompt_len = len(tokens) if prompt_len is None else prompt_len
        prompt = [int(t) for t in tokens[:prompt_len]]
        self.remove(req_id)
        self.requests.add_request(req_id, prompt_len, prompt, 0, max_tokens=len(tokens))
        index = self.requests.req_id_to_index[req_id]
        # apply_staged_writes runs a Triton kernel, which vLLM disables without a GPU driver:
        # the staged values are written as it would write them
        self.requests.all_token_ids.gpu[index].zero_()
        self.requests.all_token_ids.gpu[index, :prompt_len] = torch.as_tensor(prompt)
        self.requests.num_computed_tokens.gpu[index] = 0
        for staged in (self.requests.all_token_ids, self.requests.num_computed_tokens):
            staged.clear_staged_writes()
        self.tokens[req_id] = np.asarray(tokens, dtype=np.int64).copy()
        self.state.add_request(
            index,
            NewRequestData(
                req_id=req_id,
                prompt_token_ids=prompt,
                mm_features=[],
                sampling_params=None,
                pooling_params=None,
                block_ids=([],),
                num_computed_tokens=0,
                lora_request=None,
                prefill_token_ids=prompt,
            ),
        )

    def remove(self, req_id: str) -> None:
        """The runner's _remove_request: the model state first, then the request state."""
        if req_id in self.requests.req_id_to_index:
            self.state.remove_request(req_id)
            self.requests.remove_request(req_id)

    def rewrite(self, req_id: str, start: int, tokens: np.ndarray) -> None:
        """Later tokens replaced, as when speculated tokens are rejected and resampled."""
        self.tokens[req_id][start : start + len(tokens)] = tokens

    def step(
        self,
        scheduled,
        *,
        pad_tokens: int = 0,
        pad_reqs: int = 0,
        dummy: bool = False,
        drafts: dict[str, int] | None = None,
        host_shift: dict[str, int] | None = None,
        device_counts: dict[str, int] | None = None,
    ):
        """scheduled: (request id, tokens computed before, tokens this step) per request;
        drafts: how many of a request's tokens are MTP drafts (the last ones).
        Faults of the host's view, the device's inputs as scheduled: host_shift adds to a
        request's computed-prefill count on the host (bookkeeping off by that many tokens);
        device_counts gives a request fewer tokens on the device than the host scheduled
        (the device moved the boundaries: adaptive draft verification), the rest padding.

        Returns (input_ids, query_start_loc, ngram_context, number of real tokens) as the
        model's forward receives them; padding tokens and requests are added as CUDA-graph
        padding adds them.
        """
        from vllm.v1.worker.gpu.input_batch import InputBatch

        reqs = self.requests
        indices, lengths, chunks = [], [], []
        for req_id, computed, count in scheduled:
            index = reqs.req_id_to_index.get(req_id, len(indices))
            indices.append(index)
            lengths.append(count)
            if req_id in self.tokens:
                tokens = self.tokens[req_id]
                prompt_len = int(reqs.prefill_len.np[index])
                # what the sampler accepted so far is in all_token_ids past the prompt
                accepted = tokens[prompt_len:computed]
                reqs.all_token_ids.gpu[index, prompt_len:computed] = torch.as_tensor(accepted)
                reqs.num_computed_tokens.gpu[index] = computed
                reqs.num_computed_tokens_np[index] = computed
                on_device = (device_counts or {}).get(req_id, count)
                chunks.append(torch.as_tensor(tokens[computed : computed + on_device]))
            else:
                chunks.append(torch.zeros(count, dtype=torch.int64))
        # what the runner's update_requests derives on the host
        np.minimum(
            reqs.num_computed_tokens_np, reqs.prefill_len.np, out=reqs.num_computed_prefill_tokens
        )
        num_reqs = len(scheduled)
        num_real = sum(lengths)
        moved = num_real - sum(len(chunk) for chunk in chunks)  # tokens the device has fewer
        garbage = torch.as_tensor(self.rng.integers(0, 1000, size=pad_tokens + moved))
        input_ids = torch.cat([*chunks, garbage]).to(torch.int32).to(DEVICE)
        starts = np.concatenate([[0], np.cumsum(lengths), [num_real] * pad_reqs]).astype(np.int32)
        device_lengths = [len(chunk) for chunk in chunks]
        device_starts = np.concatenate(
            [[0], np.cumsum(device_lengths), [num_real - moved] * pad_reqs]
        ).astype(np.int32)
        idx_np = np.asarray(indices, dtype=np.intp)
        prefill_len_np = reqs.prefill_len.np[idx_np].copy()
        computed_prefill = reqs.num_computed_prefill_tokens[idx_np].copy()
        for position, (req_id, _, _) in enumerate(scheduled):
            computed_prefill[position] += (host_shift or {}).get(req_id, 0)
        is_prefilling = computed_prefill < prefill_len_np
        draft_counts = None
        if drafts is not None:
            draft_counts = np.asarray(
                [drafts.get(req_id, 0) for req_id, _, _ in scheduled], dtype=np.int32
            )
        idx_mapping = torch.as_tensor(idx_np, dtype=torch.int64, device=DEVICE)
        qsl = torch.as_tensor(device_starts, device=DEVICE)
        batch = InputBatch(
            req_ids=[
                f"dummy-{i}" if dummy else req_id for i, (req_id, _, _) in enumerate(scheduled)
            ],
            num_reqs=num_reqs,
            num_reqs_after_padding=num_reqs + pad_reqs,
            idx_mapping=idx_mapping,
            idx_mapping_np=idx_np,
            expanded_idx_mapping=idx_mapping,
            expanded_local_pos=torch.zeros(num_reqs, dtype=torch.int32, device=DEVICE),
            num_scheduled_tokens=np.asarray(lengths, dtype=np.int32),
            num_tokens=num_real,
            num_tokens_after_padding=num_real + pad_tokens,
            num_draft_tokens=0 if draft_counts is None else int(draft_counts.sum()),
            num_draft_tokens_per_req=draft_counts,
            query_start_loc=qsl,
            query_start_loc_np=starts,
            seq_lens=torch.zeros(num_reqs + pad_reqs, dtype=torch.int32, device=DEVICE),
            seq_lens_cpu_upper_bound=torch.zeros(num_reqs + pad_reqs, dtype=torch.int32),
            dcp_local_seq_lens=None,
            num_computed_tokens_np=reqs.num_computed_tokens_np[idx_np].copy(),
            prefill_len_np=prefill_len_np,
            num_computed_prefill_tokens_np=computed_prefill,
            is_prefilling_np=is_prefilling,
            has_prefill=bool(is_prefilling.any()),
            decode_graph_eligible=not bool(is_prefilling.any()),
            input_ids=input_ids,
            positions=torch.zeros(num_real + pad_tokens, dtype=torch.int64, device=DEVICE),
            is_padding=torch.zeros(num_real + pad_tokens, dtype=torch.bool, device=DEVICE),
            logits_indices=torch.zeros(num_reqs, dtype=torch.int64, device=DEVICE),
            cu_num_logits=torch.arange(num_reqs + 1, dtype=torch.int32, device=DEVICE),
            cu_num_logits_np=np.arange(num_reqs + 1, dtype=np.int32),
            has_structured_output_reqs=False,
            prompt_lens=None,
        )
        inputs = self.state.prepare_inputs(batch, reqs)
        return input_ids, inputs["query_start_loc"], inputs["ngram_context"], num_real - moved


def request_tokens(vocab: int, eos: int, seed: int, length: int = 300) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=length)
    tokens[rng.random(length) < 0.05] = eos
    tokens[[40, 41, 128]] = eos  # back-to-back EOS and one at a chunk boundary
    return tokens


def schedule(runner: Runner, vocab: int, eos: int):
    """The steps every layer sees: mixed chunked prefill and decode with padding, speculative
    verification with a rejection, steps mixing prompt chunks, decode tokens and MTP drafts, a
    prompt removed before its later chunks and its id re-added with another prompt, a prompt
    far longer than the lookahead window, one request whole, and the same request in chunks.

    Prompt lengths: r0 110, r1 256, r2 7, r3 30 (the tokens after them are decode tokens).
    """
    for r, prompt_len in enumerate((110, 256, 7, 30)):
        runner.add(f"r{r}", request_tokens(vocab, eos, seed=10 + r), prompt_len)
    yield (
        "mixed prefill",
        [("r0", 0, 50), ("r1", 0, 128), ("r2", 0, 7)],
        {"pad_tokens": 5, "pad_reqs": 1},
    )
    yield "chunk and decode", [("r1", 128, 128), ("r0", 50, 60), ("r2", 7, 1), ("r3", 0, 30)], {}
    yield (
        "uniform decode",
        [("r0", 110, 1), ("r1", 256, 1), ("r2", 8, 1), ("r3", 30, 1)],
        {"pad_tokens": 4, "pad_reqs": 4},
    )
    yield "verify drafts", [("r0", 111, 4), ("r1", 257, 4)], {"drafts": {"r0": 3, "r1": 3}}
    # two of r0's three drafts were rejected: the tokens after the accepted one change
    runner.rewrite("r0", 113, np.random.default_rng(30).integers(0, vocab, size=20))
    yield (
        "after rejection",
        [("r0", 113, 4), ("r1", 261, 4)],
        {"pad_tokens": 8, "drafts": {"r0": 3, "r1": 3}},
    )
    # a long prompt (r4, 600 tokens: many lookahead windows) in chunks, beside decoding
    # requests with MTP drafts and a prompt (r5) that is removed after its first chunk
    runner.add("r5", request_tokens(vocab, eos, seed=50), 300)
    runner.add("r4", request_tokens(vocab, eos, seed=40, length=700), 600)
    yield (
        "prompt, decode and drafts",
        [("r0", 117, 4), ("r2", 9, 1), ("r4", 0, 100), ("r5", 0, 64)],
        {"pad_tokens": 3, "drafts": {"r0": 3}},
    )
    runner.remove("r5")
    yield (
        "after a removed prompt",
        [("r0", 121, 4), ("r3", 31, 4), ("r4", 100, 150)],
        {"drafts": {"r0": 3, "r3": 3}},
    )
    # the same request id again, with another prompt (vLLM's streaming input update)
    runner.add("r5", request_tokens(vocab, eos, seed=51), 200)
    yield "re-added prompt", [("r5", 0, 64), ("r4", 250, 150), ("r2", 10, 1)], {}
    yield "prompt tail and decode", [("r4", 400, 200), ("r5", 64, 136), ("r3", 35, 1)], {}
    yield "long prompt decodes", [("r4", 600, 4), ("r5", 200, 1)], {"drafts": {"r4": 3}}
    whole = request_tokens(vocab, eos, seed=20)
    runner.add("whole", whole)
    runner.add("chunked", whole, 256)
    yield "whole", [("whole", 0, len(whole))], {}
    position = 0
    for size in [128, 128] + [1] * (len(whole) - 256):
        yield "chunked", [("chunked", position, size)], {}
        position += size


def kernel_order_step(layer, input_ids, query_start_loc, ngram_context) -> torch.Tensor:
    """The stock layer's rows decoded in the order of vLLM's CUDA lookup kernel.

    vLLM 0.33 multiplies (E2M1 x block scale) x global scale in its CUDA kernel but
    E2M1 x (block scale x global scale) on CPU; in float32 the two can differ in the last bit.
    This applies the kernel's order to the stock layer's own rows, with vLLM's nibble decoder.
    """
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        break_fp4_bytes,
    )

    ids = layer.compute_ngram_ids(input_ids, query_start_loc, ngram_context).reshape(-1)
    table = layer.ngram_embedding
    e2m1 = break_fp4_bytes(table.weight[ids], torch.float32)
    blocks = e2m1.reshape(ids.shape[0], -1, 16) * table.weight_scale[ids].float().unsqueeze(-1)
    rows = blocks * table.weight_scale_2.float().reshape(())
    return rows.reshape(input_ids.shape[0], -1)


def stock_rows(stock, input_ids, query_start_loc, ngram_context, dtype) -> torch.Tensor:
    """Stock vLLM's rows of a step, the reference of the GPU checks: its own lookup on CUDA;
    on the CPU its device backend's rows in the order its CUDA kernel multiplies the scales."""
    if DEVICE.type == "cuda":
        return forward(stock, input_ids, query_start_loc, ngram_context)
    return kernel_order_step(stock, input_ids, query_start_loc, ngram_context).to(dtype)


def resident_bytes(layer) -> int:
    tensors = list(layer.parameters()) + list(layer.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")


def seed_loader_filter(rendered: Path) -> None:
    """The patched loader filter in place before vLLM's model loader first imports it (the
    container's bind mount lays it over the image's file before the server starts)."""
    if LOADER_FILTER in sys.modules:
        raise RuntimeError(f"{LOADER_FILTER} was imported before the patch was laid over it")
    path = rendered / "model_executor" / "model_loader" / "ep_weight_filter.py"
    spec = importlib.util.spec_from_file_location(LOADER_FILTER, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[LOADER_FILTER] = module
    spec.loader.exec_module(module)


def patched_modules(rendered: Path):
    """The patched n-gram and model-state modules, laid over the package as the mounts do
    (the patched common module too: its quant methods run the table's check at load)."""
    for package in ("vllm.models.qwen4_exp.nvidia", "vllm.models.qwen4_exp.common"):
        sub = package.split(".", 1)[1].replace(".", "/")
        importlib.import_module(package).__path__.insert(0, str(rendered / sub))
    for name in (NGRAM_MODULE, STATE_MODULE, COMMON_MODULE):
        sys.modules.pop(name, None)
    return importlib.import_module(NGRAM_MODULE), importlib.import_module(STATE_MODULE)


def as_tensors(*arrays):
    return tuple(torch.as_tensor(np.asarray(x), dtype=torch.int64, device=DEVICE) for x in arrays)


def counters(embedding) -> tuple[int, int, int]:
    """Rows gathered, gathers and handshake waits the backend has recorded."""
    snapshot = embedding._stats.snapshot()
    done = snapshot["counters"]
    return done["rows_gathered"], done["gather_calls"], snapshot["handshake_wait_seconds"]["count"]


def in_forward(embedding, num_tokens: int) -> torch.Tensor:
    """What the PLE layer runs of the backend inside the forward: lookup, then dequantize."""
    return embedding.dequantize(embedding.finalize_prefetch(num_tokens), embedding.params_dtype)


def compare(stock_module, patched, state_module, snapshot: Path, table_dir: Path) -> dict:
    from transformers import Qwen4ExpTextConfig

    from sparkple.geometry import PLEGeometry
    from sparkple.runtime.ngram import row_ids

    result: dict = {}
    raw = json.loads((snapshot / "config.json").read_text())
    config = Qwen4ExpTextConfig(**raw["text_config"])
    geometry = PLEGeometry.from_config(raw)
    prefix = f"model.language_model.layers.{PLE_DECODER_LAYER}.ple.ple_embedding."
    eos, vocab = int(config.eos_token_id), int(config.vocab_size)
    nvfp4 = raw["text_config"]["ple_embedding_dtype"] == "nvfp4"
    result["quant"] = "nvfp4" if nvfp4 else "fp8"
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}

    def shard_reads(layer) -> int:
        return sum(".ngram_embedding.shard_" in name for name in layer.materialized)

    os.environ.pop("SPARKPLE_PLE_TABLE_DIR", None)
    stock_layers = {
        k: build(stock_module, config, snapshot, prefix, d)[0] for k, d in dtypes.items()
    }
    stock_layer = stock_layers["float32"]
    result["stock_backend"] = type(stock_layer.ngram_embedding).__name__
    result["stock_resident_bytes"] = resident_bytes(stock_layer)
    result["stock_load_rss_growth"] = stock_layer.load_rss_growth
    result["stock_shard_tensors_read"] = shard_reads(stock_layer)

    # sparkple.runtime.ngram against vLLM's own compute_ngram_ids, random batches
    rng = np.random.default_rng(3)
    mismatched = 0
    for _ in range(50):
        lengths = rng.integers(1, 40, size=rng.integers(1, 6))
        tokens = rng.integers(0, vocab, size=int(lengths.sum()))
        tokens[rng.random(tokens.shape[0]) < rng.random() * 0.3] = eos
        starts = np.concatenate([[0], np.cumsum(lengths)])
        context = rng.integers(0, vocab, size=(len(lengths), 2))
        context[rng.random(context.shape) < 0.3] = eos
        theirs = stock_layer.compute_ngram_ids(*as_tensors(tokens, starts, context)).cpu().numpy()
        ours = row_ids(tokens, starts, context, geometry)
        mismatched += int(not np.array_equal(theirs, ours))
    result["ngram_trials"] = 50
    result["ngram_mismatched"] = mismatched

    os.environ["SPARKPLE_PLE_TABLE_DIR"] = str(table_dir)
    patched_built = {k: build(patched, config, snapshot, prefix, d) for k, d in dtypes.items()}
    patched_layers = {k: layer for k, (layer, _) in patched_built.items()}
    result["patched_module_file"] = patched.__file__
    layer, loaded = patched_built["float32"]
    embedding = layer.ngram_embedding
    result["patched_backend"] = type(embedding).__name__
    result["patched_loaded"] = sorted(loaded)
    result["patched_weight_devices"] = sorted(
        {embedding.weight.device.type} | ({embedding.weight_scale.device.type} if nvfp4 else set())
    )
    # the backend's own per-step buffers (rows of one step, decode tables) apart from the table
    step_buffers = sum(b.numel() * b.element_size() for b in embedding.buffers())
    result["patched_step_buffer_bytes"] = step_buffers
    result["patched_resident_bytes"] = resident_bytes(layer) - step_buffers
    result["patched_load_rss_growth"] = layer.load_rss_growth
    result["patched_shard_tensors_read"] = shard_reads(layer)
    result["patched_tensors_read"] = sorted(
        name[len(prefix) :] for name in layer.materialized if name.startswith(prefix)
    )
    result["table_bytes"] = int(embedding.table.meta.data_bytes)
    result["table_advice"] = embedding.table.advice
    scale = embedding.weight_scale_2 if nvfp4 else embedding.weight_scale
    result["global_scale_loaded"] = float(scale.reshape(-1)[0])
    result["global_scale_table"] = float(embedding.table.meta.global_scale)
    result["buffers_equal"] = all(
        torch.equal(getattr(layer, name), getattr(stock_layer, name))
        for name in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
    )

    # constructed where vLLM would build it on another device: host buffers stay on the CPU
    with torch.device("meta"):
        meta_layer = patched.Qwen4ExpNGramEmbedding(
            config,
            int(config.ple_embed_dim),
            0,
            MAX_TOKENS,
            data_parallel_rank=0,
            prefix=prefix.rstrip("."),
            params_dtype=torch.float32,
        )
    meta = meta_layer.ngram_embedding
    result["meta_device_buffers"] = sorted({b.device.type for b in meta.buffers()})
    host = [*meta._host_inputs, torch.from_numpy(meta._worker.staging)]
    result["meta_host_buffers"] = sorted({t.device.type for t in host})
    meta.close()

    # every step through vLLM's model state: its prepare_inputs runs the host step
    state = model_state(state_module, torch.nn.ModuleList(patched_layers.values()), config)
    runner = Runner(state)
    steps = {k: [] for k in dtypes}
    result["compiled_steps"] = {}
    result["synced_steps"] = []
    for name, scheduled, padding in schedule(runner, vocab, eos):
        input_ids, qsl, ctx, real = runner.step(scheduled, **padding)
        # whether the host step waited for the device's copy of the inputs
        result["synced_steps"].append(state.model._sparkple_host_step.last_synced)
        # the device would run the step now: the lookahead advises meanwhile
        for layer in patched_layers.values():
            layer.ngram_embedding._lookahead.idle()
        for key, dtype in dtypes.items():
            ours = forward(patched_layers[key], input_ids, qsl, ctx)
            theirs = forward(stock_layers[key], input_ids, qsl, ctx)
            kernel = (
                kernel_order_step(stock_layers[key], input_ids, qsl, ctx).to(dtype)
                if nvfp4
                else theirs
            )
            steps[key].append((name, ours[:real], theirs[:real], kernel[:real], ours[real:]))
        if name in ("mixed prefill", "uniform decode"):
            # the in-forward path under torch.compile(fullgraph=True), on a prefill-shaped
            # and a decode-shaped step: any graph break or host synchronization raises
            torch._dynamo.reset()
            compiled_steps = result["compiled_steps"][name] = []
            for key in dtypes:
                emb = patched_layers[key].ngram_embedding
                compiled = torch.compile(in_forward, fullgraph=True, backend="eager")
                eager = in_forward(emb, input_ids.shape[0])
                compiled_steps.append(bool(torch.equal(compiled(emb, input_ids.shape[0]), eager)))
    for key in dtypes:
        done = steps[key]
        result[f"{key}_steps"] = len(done)
        result[f"{key}_identical"] = [bool(torch.equal(o, t)) for _, o, t, _, _ in done]
        result[f"{key}_identical_to_kernel_order"] = [
            bool(torch.equal(o, k)) for _, o, _, k, _ in done
        ]
        result[f"{key}_max_abs_diff"] = max(
            float((o.float() - t.float()).abs().max()) for _, o, t, _, _ in done
        )
        result[f"{key}_max_rel_diff"] = max(
            float(((o.float() - t.float()).abs() / t.float().abs().clamp_min(1e-30)).max())
            for _, o, t, _, _ in done
        )
        result[f"{key}_nonzero"] = all(bool(t.abs().sum() > 0) for _, _, t, _, _ in done)
        result[f"{key}_padding_rows_zero"] = all(
            bool((p.float() == 0).all()) for *_, p in done
        ) and any(p.shape[0] > 0 for *_, p in done)
        whole = [o for n, o, _, _, _ in done if n == "whole"]
        chunked = torch.cat([o for n, o, _, _, _ in done if n == "chunked"])
        stock_whole = [t for n, _, t, _, _ in done if n == "whole"]
        stock_chunked = torch.cat([t for n, _, t, _, _ in done if n == "chunked"])
        result[f"{key}_chunked_equals_whole"] = bool(
            torch.equal(whole[0], chunked) and torch.equal(stock_whole[0], stock_chunked)
        )
    result["step_names"] = [n for n, *_ in steps["float32"]]
    # the lookahead of both layers: what it advised, what steps used, what a removal wasted
    for layer in patched_layers.values():
        layer.ngram_embedding._lookahead.idle()
    emb = patched_layers["float32"].ngram_embedding
    done = emb._stats.snapshot()["counters"]
    result["lookahead"] = {
        "advised": done["lookahead_pages_advised"],
        "used": done["lookahead_pages_used"],
        "wasted": done["lookahead_pages_wasted"],
        "peak_pages": emb._lookahead.peak_outstanding_pages,
        "window_pages": emb._lookahead.window_pages,
        "prompts_held": sorted(state.model._sparkple_host_step.slots),
    }

    # dummy, profile and capture runs: zeros, no table row read, no wait
    emb = patched_layers["float32"].ngram_embedding
    before = counters(emb)
    dummy_inputs = state.prepare_dummy_inputs(4, 64)
    zeros = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    dummy_out = [
        forward(
            patched_layers["float32"],
            zeros,
            dummy_inputs["query_start_loc"],
            dummy_inputs["ngram_context"],
        )
    ]
    input_ids, qsl, ctx, _ = runner.step([("r0", 0, 16), ("r1", 0, 16)], dummy=True)
    dummy_out.append(forward(patched_layers["float32"], input_ids, qsl, ctx))
    result["dummy_outputs_zero"] = [bool((out == 0).all()) for out in dummy_out]
    result["dummy_counters_before_after"] = [before, counters(emb)]

    for layer in patched_layers.values():
        layer.ngram_embedding.close()

    # the patched files without the env var: vLLM's own backend, as before
    os.environ.pop("SPARKPLE_PLE_TABLE_DIR")
    unset, _ = build(patched, config, snapshot, prefix, torch.float32)
    result["patched_unset_backend"] = type(unset.ngram_embedding).__name__
    result["patched_unset_shard_tensors_read"] = shard_reads(unset)
    # a directory that holds no table: a clear error, no silent fallback
    os.environ["SPARKPLE_PLE_TABLE_DIR"] = str(snapshot.parent / "no-table-here")
    try:
        build(patched, config, snapshot, prefix, torch.float32)
        result["missing_table_error"] = None
    except Exception as exc:
        result["missing_table_error"] = f"{type(exc).__name__}: {exc}"
    os.environ.pop("SPARKPLE_PLE_TABLE_DIR")
    result["device"] = DEVICE.type
    return result


class _FailingPrefetch:
    """Stands in for the page prefetch in the gather thread, to make a step fail."""

    def __init__(self, error: BaseException, delay_s: float = 0.0) -> None:
        self.error, self.delay_s = error, delay_s

    def prefetch(self, row_ids):
        time.sleep(self.delay_s)
        raise self.error


def failures(patched, state_module, snapshot: Path, table_dir: Path) -> dict:
    """A table I/O error, a step timeout and a dead gather thread end prepare_inputs with an
    exception (vLLM's engine then dies and is relaunched), each within its bound."""
    from transformers import Qwen4ExpTextConfig

    raw = json.loads((snapshot / "config.json").read_text())
    config = Qwen4ExpTextConfig(**raw["text_config"])
    prefix = f"model.language_model.layers.{PLE_DECODER_LAYER}.ple.ple_embedding."
    cases = {
        "io_error": (_FailingPrefetch(OSError(5, "Input/output error")), 60.0),
        "timeout": (_FailingPrefetch(OSError(5, "late"), delay_s=2.0), 0.2),
        "dead_thread": (_FailingPrefetch(SystemExit()), 60.0),
    }
    seen = {}
    os.environ["SPARKPLE_PLE_TABLE_DIR"] = str(table_dir)
    # these layers' counters stay out of the stats file the real steps' layer wrote
    stats_dir = os.environ.pop("SPARKPLE_STATS_DIR", None)
    try:
        for case, (prefetch, timeout_s) in cases.items():
            layer, _ = build(patched, config, snapshot, prefix, torch.float32)
            embedding = layer.ngram_embedding
            embedding._worker.prefetcher = prefetch
            embedding._timeout_s = timeout_s
            runner = Runner(model_state(state_module, torch.nn.ModuleList([layer]), config))
            runner.add("r0", request_tokens(int(config.vocab_size), int(config.eos_token_id), 1))
            started = time.monotonic()
            try:
                runner.step([("r0", 0, 16)])
                seen[case] = None
            except BaseException as exc:  # what vLLM's execute_model would see
                seen[case] = {
                    "error": f"{type(exc).__name__}: {exc}",
                    "seconds": round(time.monotonic() - started, 3),
                }
            embedding.close()
    finally:
        os.environ.pop("SPARKPLE_PLE_TABLE_DIR")
        if stats_dir is not None:
            os.environ["SPARKPLE_STATS_DIR"] = stats_dir
    return seen


BACKEND_MODULE = "vllm.models.qwen4_exp.common.ple_mmap_embedding"


def host_checks(stock_module, patched, state_module, snapshot: Path, table_dir: Path) -> dict:
    """The host step's checks of its own view against the device's inputs, step by step: its
    rows (against the stock layer on the device's inputs, in vLLM's kernel order), whether it
    waited for the device, and the mismatches it counted.

    shifted_N: the host's computed-prefill count of prompt p is N tokens ahead of the device's
    from the second step on (a bookkeeping fault), beside a decoding request d0, then alone;
    unprobed: the same shift with the probes off (HOST_PROBES 0), the check this adds.
    moved: the device verifies fewer drafts of r0 than the host scheduled (its request
    boundaries moved), which the host sees in the boundaries it copies.
    """
    from transformers import Qwen4ExpTextConfig

    raw = json.loads((snapshot / "config.json").read_text())
    config = Qwen4ExpTextConfig(**raw["text_config"])
    prefix = f"model.language_model.layers.{PLE_DECODER_LAYER}.ple.ple_embedding."
    eos, vocab = int(config.eos_token_id), int(config.vocab_size)
    os.environ.pop("SPARKPLE_PLE_TABLE_DIR", None)
    stock, _ = build(stock_module, config, snapshot, prefix, torch.float32)
    backend = importlib.import_module(BACKEND_MODULE)
    probes = backend.HOST_PROBES

    def run(steps, requests, probes_on: bool = True) -> dict:
        layer, _ = build(patched, config, snapshot, prefix, torch.float32)
        state = model_state(state_module, torch.nn.ModuleList([layer]), config)
        runner = Runner(state)
        for req_id, seed, prompt_len, length in requests:
            runner.add(req_id, request_tokens(vocab, eos, seed=seed, length=length), prompt_len)
        backend.HOST_PROBES = probes if probes_on else 0
        out: dict = {"rows_right": [], "synced": [], "mismatches": []}
        try:
            for scheduled, kwargs in steps:
                input_ids, qsl, ctx, real = runner.step(scheduled, **kwargs)
                ours = forward(layer, input_ids, qsl, ctx)[:real]
                theirs = kernel_order_step(stock, input_ids, qsl, ctx)[:real]
                out["rows_right"].append(bool(torch.equal(ours, theirs)))
                out["synced"].append(state.model._sparkple_host_step.last_synced)
                counted = layer.ngram_embedding._stats.snapshot()["counters"]
                out["mismatches"].append(counted["host_device_mismatch"])
        finally:
            backend.HOST_PROBES = probes
            layer.ngram_embedding.close()
        return out

    def shifted(by: int) -> list:
        shift = {"host_shift": {"p": by}}
        return [
            ([("d0", 0, 32), ("p", 0, 64)], {}),
            ([("d0", 32, 1), ("p", 64, 64)], shift),
            ([("d0", 33, 1), ("p", 128, 64)], shift),
            ([("p", 192, 64)], shift),
        ]

    prompts = [("d0", 3, 32, 200), ("p", 4, 400, 400)]
    os.environ["SPARKPLE_PLE_TABLE_DIR"] = str(table_dir)
    stats_dir = os.environ.pop("SPARKPLE_STATS_DIR", None)  # out of the real steps' file
    try:
        result = {f"shifted_{by}": run(shifted(by), prompts) for by in (1, 4)}
        result["unprobed"] = run(shifted(1), prompts, probes_on=False)
        drafts = {"drafts": {"r0": 3, "r1": 3}}
        result["moved"] = run(
            [
                ([("r0", 0, 40), ("r1", 0, 50)], {}),
                ([("r0", 40, 1), ("r1", 50, 1)], {}),
                ([("r0", 41, 4), ("r1", 51, 4)], {**drafts, "device_counts": {"r0": 2}}),
                ([("r0", 43, 4), ("r1", 55, 4)], drafts),
            ],
            [("r0", 5, 40, 200), ("r1", 6, 50, 200)],
        )
    finally:
        os.environ.pop("SPARKPLE_PLE_TABLE_DIR")
        if stats_dir is not None:
            os.environ["SPARKPLE_STATS_DIR"] = stats_dir
    return result


def refusals(patched, snapshot: Path, table_dir: Path) -> dict:
    """Settings the packed table cannot serve are refused at construction, by name."""
    from transformers import Qwen4ExpTextConfig
    from vllm.config import get_current_vllm_config

    raw = json.loads((snapshot / "config.json").read_text())
    config = Qwen4ExpTextConfig(**raw["text_config"])
    current = get_current_vllm_config()
    parallel = current.parallel_config

    @contextmanager
    def setting(owner=parallel, **values):
        saved = {field: getattr(owner, field) for field in values}
        for field, value in values.items():
            object.__setattr__(owner, field, value)
        try:
            yield
        finally:
            for field, value in saved.items():
                object.__setattr__(owner, field, value)

    from vllm.config import EngramConfig

    across_dp = EngramConfig(cpu_offload=False, embedding_across_dp=True)
    cases = {
        "pipeline": setting(pipeline_parallel_size=2),
        "prefill_context_parallel": setting(prefill_context_parallel_size=2),
        "v1_runner": mock.patch.dict(os.environ, {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
        "tensor_parallel_4": setting(tensor_parallel_size=4),
        "sequence_parallel": setting(tensor_parallel_size=2, enable_hc_sp=True),
        "embedding_across_dp": setting(current, engram_config=across_dp),
    }
    messages = {}
    os.environ["SPARKPLE_PLE_TABLE_DIR"] = str(table_dir)
    try:
        for case, context in cases.items():
            with context:
                try:
                    patched.Qwen4ExpNGramEmbedding(
                        config,
                        int(config.ple_embed_dim),
                        0,
                        MAX_TOKENS,
                        data_parallel_rank=0,
                        prefix="ple",
                        params_dtype=torch.float32,
                    )
                    messages[case] = None
                except ValueError as exc:
                    messages[case] = str(exc)
    finally:
        os.environ.pop("SPARKPLE_PLE_TABLE_DIR")
    return messages


def main() -> None:
    rendered, result_path = Path(sys.argv[2]), Path(sys.argv[3])
    cases = [tuple(map(Path, arg.split("=", 1))) for arg in sys.argv[4:]]
    seed_loader_filter(rendered)
    results = {}
    with tempfile.TemporaryDirectory() as work, vllm_context(Path(work)):
        stock_module = importlib.import_module(NGRAM_MODULE)
        patched, state_module = patched_modules(rendered)
        for snapshot, table_dir in cases:
            result = compare(stock_module, patched, state_module, snapshot, table_dir)
            results[result["quant"]] = result
        snapshot, table_dir = cases[0]
        results["refusals"] = refusals(patched, snapshot, table_dir)
        results["failures"] = failures(patched, state_module, snapshot, table_dir)
        results["host_checks"] = host_checks(
            stock_module, patched, state_module, snapshot, table_dir
        )
    result_path.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
