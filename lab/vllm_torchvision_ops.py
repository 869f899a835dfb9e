"""Imported at every Python start of the lab's real-vLLM serving image (lab/serving-vllm.Dockerfile
puts it in site-packages with a .pth line that imports it).

vLLM 0.34's Qwen3.5/Qwen4Exp model code imports transformers' Qwen2-VL image processor, which
imports torchvision, even for the language model alone. PyPI's torchvision for x86_64 is built
against CUDA torch: on the image's CPU torch its compiled ops (`torchvision._C`) do not load,
which torchvision tolerates, except that its fake-tensor registrations of `torchvision::nms`
and `torchvision::qnms` then name operators that do not exist and its import fails. This
defines those two operators' schemas (no kernels: the lab serves no vision input, and calling
either raises) right before torchvision is first imported, so the import succeeds. Nothing else
changes, and a process that never imports torchvision never imports torch here.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import sys
from typing import Any

# the two operators' schemas, as torchvision's compiled ops define them
SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARIES: list[Any] = []


class _DefineTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        # torch.library is untyped: imported as Any
        torch_library: Any = importlib.import_module("torch.library")
        library = torch_library.Library("torchvision", "FRAGMENT")
        for schema in SCHEMAS.values():
            # an operator defined already (torchvision's own ops loaded) is left as it is
            with contextlib.suppress(RuntimeError):
                library.define(schema)
        _LIBRARIES.append(library)
        return None  # the regular finders import torchvision itself


sys.meta_path.insert(0, _DefineTorchvisionOps())
