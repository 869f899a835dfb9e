"""vLLM's side of the PLE checks: its config and groups, the Qwen4Exp PLE layer built from a
checkpoint (stock, or with the rendered patch files laid over the package), vLLM's own model
state and request state, and the layer's rows as a forward reads them.

Imported inside the vLLM test venv. The device is the first command-line argument of the
script that imports it ("cpu" or "cuda"), read once at import.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch

from harness.lay_over import LOADER_FILTER, lay_over_packages, load_loader_filter

# a step's most tokens (bench/host_step.py sets its own before the first request_states)
MAX_TOKENS = 512
PLE_DECODER_LAYER = 1  # ple_layer_ids [2] is one-based
# "cpu" (CI) or "cuda" (where vLLM's Triton kernels and the pinned-staging copy run)
DEVICE = torch.device(sys.argv[1])
NGRAM_MODULE = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
STATE_MODULE = "vllm.models.qwen4_exp.nvidia.model_state"
COMMON_MODULE = "vllm.models.qwen4_exp.common.ngram_embedding"
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


@contextmanager
def config_fields(owner: object, **values: object) -> Iterator[None]:
    """Set fields of a frozen vLLM config (its dataclasses refuse plain assignment) for the
    length of a `with` block, and put the old values back after it."""
    saved = {name: getattr(owner, name) for name in values}
    for name, value in values.items():
        object.__setattr__(owner, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            object.__setattr__(owner, name, value)


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
    this device (the unspecified platform vLLM sees here names no device type). vLLM 0.34's
    explicit-copy buffer asks for pinned memory itself where the platform offers it: it is
    told none is (0.33's has no such probe).
    """
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.states import RequestState

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(buffer_utils, "is_uva_available", lambda: False))
        stack.enter_context(mock.patch.object(type(current_platform), "device_type", DEVICE.type))
        if hasattr(buffer_utils, "is_pin_memory_available") and DEVICE.type == "cpu":
            stack.enter_context(
                mock.patch.object(buffer_utils, "is_pin_memory_available", lambda: False)
            )
        return RequestState(
            MAX_REQS, max_model_len, MAX_TOKENS, 3, 1 << 20, DEVICE, use_dense_all_token_ids=True
        )


def kernel_order_decode(codes, scales, weight_scale_2, tokens: int) -> torch.Tensor:
    """NVFP4 rows (codes [rows, 80], E4M3 block scales [rows, 10]) decoded in the order of
    vLLM's CUDA lookup kernel, with vLLM's nibble decoder: (E2M1 x block scale) x global scale,
    in float32, as [tokens, heads x 160]."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        break_fp4_bytes,
    )

    rows = codes.shape[0]
    e2m1 = break_fp4_bytes(codes, torch.float32)
    blocks = e2m1.reshape(rows, -1, 16) * scales.float().unsqueeze(-1)
    return (blocks * weight_scale_2.float().reshape(())).reshape(tokens, -1)


def kernel_order_step(layer, input_ids, query_start_loc, ngram_context) -> torch.Tensor:
    """The stock layer's rows decoded in the order of vLLM's CUDA lookup kernel.

    vLLM 0.33 multiplies (E2M1 x block scale) x global scale in its CUDA kernel but
    E2M1 x (block scale x global scale) on CPU; in float32 the two can differ in the last bit.
    This applies the kernel's order to the stock layer's own rows.
    """
    ids = layer.compute_ngram_ids(input_ids, query_start_loc, ngram_context).reshape(-1)
    table = layer.ngram_embedding
    return kernel_order_decode(
        table.weight[ids], table.weight_scale[ids], table.weight_scale_2, input_ids.shape[0]
    )


def disk_offload_layer(
    module, config, snapshot: Path, prefix: str, dtype: torch.dtype, max_tokens: int | None = None
):
    """vLLM's own disk-offload backend (0.34: `--engram-config '{"disk_offload": true}'`),
    built and loaded as vLLM builds it, or None where the release has none (0.33). Its staging
    holds `max_tokens` tokens (MAX_TOKENS as set when called, by default).

    vLLM refuses disk_offload off CUDA when it validates an EngramConfig, so the flag is set
    on a validated one; what runs on a CPU is the backend's host half (its file offsets from
    the loader's mmap views, its reads into the staging planes), as on CUDA.
    """
    if not hasattr(module, "Qwen4ExpPLEDiskOffloadEmbedding"):
        return None
    from vllm.config import EngramConfig, get_current_vllm_config

    disk = EngramConfig(cpu_offload=False)
    object.__setattr__(disk, "disk_offload", True)
    with config_fields(get_current_vllm_config(), engram_config=disk):
        tokens = MAX_TOKENS if max_tokens is None else max_tokens
        layer, _ = build(module, config, snapshot, prefix, dtype, tokens)
    assert type(layer.ngram_embedding).__name__ == "Qwen4ExpPLEDiskOffloadEmbedding"
    return layer


def disk_offload_step(module, layer, input_ids, query_start_loc, ngram_context) -> torch.Tensor:
    """The rows vLLM's disk offload gives the forward of a step: its `stage_checkpoint_rows`
    (what its model state calls before each forward: the ids hashed, copied to the host, the
    pages advised, one read per distinct row into the staging planes), then the forward: FP8
    rows as the PLE layer reads them; NVFP4 rows from its staged planes decoded in the order
    of its CUDA kernel (the decode is a Triton kernel, as the stock rows are: kernel_order_step).
    """
    embedding = layer.ngram_embedding
    module.stage_checkpoint_rows([(layer, embedding)], input_ids, query_start_loc, ngram_context)
    if not embedding._nvfp4:
        return forward(layer, input_ids, query_start_loc, ngram_context)
    tokens = input_ids.shape[0]
    codes, scales = (staging[:tokens].flatten(0, 1) for staging, _, _ in embedding._planes.values())
    # the kernel writes the layer's dtype
    rows = kernel_order_decode(codes, scales, embedding.weight_scale_2, tokens)
    return rows.to(embedding.params_dtype)


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
    load_loader_filter(rendered)


def patched_modules(rendered: Path):
    """The patched n-gram and model-state modules, laid over the package as the mounts do
    (the patched common module too: its quant methods run the table's check at load)."""
    lay_over_packages(rendered)
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
