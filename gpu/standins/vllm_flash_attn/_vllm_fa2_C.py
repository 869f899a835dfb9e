"""Stand-in for vLLM's compiled FlashAttention 2 extension (the GPU check's sources only).

On the CUDA platform `v1/attention/backends/fa_utils.py` imports `vllm.vllm_flash_attn`, whose
`__init__` raises ImportError unless `_vllm_fa2_C` or `_vllm_fa3_C` imports. The PLE modules
reach it through vLLM's model utilities and loader, which import the attention layers. The
extensions are 300 and 170 MB, too big to carry, and the checks run no attention: this file
lets the package import, registers no op (`torch.ops._vllm_fa2_C` stays empty, so any attention
call raises), and refuses any use of itself, each use written to $SPARKPLE_STANDIN_LOG.
"""

from __future__ import annotations

import os

STANDIN = True


def __getattr__(name: str) -> object:
    log = os.environ.get("SPARKPLE_STANDIN_LOG")
    if log:
        with open(log, "a") as out:
            out.write(f"refused {__name__}.{name}\n")
    raise AttributeError(
        f"{__name__} is the GPU check's stand-in for vLLM's compiled FlashAttention: {name!r} "
        "is not here (run the check against an installed vLLM to use its kernels)"
    )
