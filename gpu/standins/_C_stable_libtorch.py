"""Stand-in for vLLM's compiled `vllm._C_stable_libtorch` (the GPU check's sources only).

The GPU check carries vLLM's Python files, not its compiled ops, and `vllm/platforms/cuda.py`
imports this module at its top with no guard (to register the custom ops). The checks call
none of those ops: this file lets the CUDA platform import, registers nothing, and refuses
any use, writing each use to $SPARKPLE_STANDIN_LOG (when set) so a test can see there was none.
"""

from __future__ import annotations

import os

STANDIN = True


def __getattr__(name: str) -> object:
    log = os.environ.get("SPARKPLE_STANDIN_LOG")
    if log:
        with open(log, "a") as out:
            out.write(f"{__name__}.{name}\n")
    raise AttributeError(
        f"{__name__} is the GPU check's stand-in for vLLM's compiled ops: {name!r} is not "
        "here (run the check against an installed vLLM to use its kernels)"
    )
