"""The rendered patch files laid over vLLM in a test process, as the serving container's bind
mounts lay them over the image's files: the loader filter as the module vLLM's model loader
imports, and the patched model packages' directories first on their paths.

Standard library only: the GPU check's import smoke test uses it before it imports vLLM's
modules, and the harness before it builds a layer.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path

LOADER_FILTER = "vllm.model_executor.model_loader.ep_weight_filter"
PATCHED_PACKAGES = ("vllm.models.qwen4_exp.nvidia", "vllm.models.qwen4_exp.common")


def load_loader_filter(rendered: Path) -> None:
    """The rendered loader filter, executed as the module vLLM's loader imports by name."""
    path = rendered / "model_executor" / "model_loader" / "ep_weight_filter.py"
    spec = importlib.util.spec_from_file_location(LOADER_FILTER, path)
    assert spec is not None and spec.loader is not None  # a .py file's spec has a loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[LOADER_FILTER] = module
    spec.loader.exec_module(module)


def lay_over_packages(rendered: Path, packages: Iterable[str] = PATCHED_PACKAGES) -> None:
    """Each package's rendered directory first on its __path__: its patched modules import
    from the rendered files, the rest from vLLM's own."""
    for package in packages:
        sub = package.split(".", 1)[1].replace(".", "/")
        importlib.import_module(package).__path__.insert(0, str(rendered / sub))
