"""Stand-in for vLLM's compiled `vllm._C_stable_libtorch` (the GPU check's sources only).

The GPU check carries vLLM's Python files, not its compiled ops, and `vllm/platforms/cuda.py`
imports this module at its top with no guard: the real one registers vLLM's custom ops under
`torch.ops._C`. On the CUDA path one of those is called while modules import:
`quantization/utils/w8a8_utils.py` sets `CUTLASS_BLOCK_FP8_SUPPORTED` from
`torch.ops._C.cutlass_scaled_mm_supports_block_fp8(capability)`, so without it the patched
n-gram embedding cannot import on a GPU. This file registers only vLLM's CUTLASS support
queries, and they answer False, which is true here: there are no CUTLASS kernels in the
sources. It registers no kernel; any other use of this module raises. Each query answered and
each use refused is written to $SPARKPLE_STANDIN_LOG (when set), so a test can see that the
checks call nothing from it.
"""

from __future__ import annotations

import os

import torch

STANDIN = True
# vLLM's CUTLASS support queries (csrc/torch_bindings.cpp registers them with these schemas)
SUPPORT_QUERIES = (
    "cutlass_scaled_mm_supports_fp8",
    "cutlass_scaled_mm_supports_block_fp8",
    "cutlass_group_gemm_supported",
)


def _log(line: str) -> None:
    log = os.environ.get("SPARKPLE_STANDIN_LOG")
    if log:
        with open(log, "a") as out:
            out.write(f"{line}\n")


def _no_cutlass_here(name: str):
    def query(cuda_device_capability: int) -> bool:
        _log(f"answered {name}({cuda_device_capability})")
        return False

    return query


def _register() -> torch.library.Library | None:
    namespace = getattr(torch.ops, "_C", None)
    if namespace is not None and any(hasattr(namespace, name) for name in SUPPORT_QUERIES):
        return None  # vLLM's real ops are loaded (an installed vLLM): leave them
    library = torch.library.Library("_C", "FRAGMENT")
    for name in SUPPORT_QUERIES:
        library.define(f"{name}(int cuda_device_capability) -> bool")
        library.impl(name, _no_cutlass_here(name), "CompositeExplicitAutograd")
    return library


_LIBRARY = _register()  # kept: the registrations live as long as the Library object


def __getattr__(name: str) -> object:
    _log(f"refused {__name__}.{name}")
    raise AttributeError(
        f"{__name__} is the GPU check's stand-in for vLLM's compiled ops: {name!r} is not "
        "here (run the check against an installed vLLM to use its kernels)"
    )
