"""The package's layers, read from the sources with ast: imports run one way between the
subpackages, and each layer imports only what the Python that runs it has.

  sparkple/*.py   the base (errors, geometry, meminfo, ...): imports no subpackage
  runtime/        the PLE runtime in the serving process: the base
  builder/        the table builder: the base and the runtime's table format and codec
  serving/        the serving plan: the base and the builder's safetensors header reader
  patch/          the patch engine: the base
  vllm/           the vLLM adapter (0.33, 0.34) in the serving process: the base and the runtime
  supervise/      one Spark's host programs: the base and the runtime's table metadata
  pair/           two Sparks at TP 2: the base, the serving plan and one Spark's supervision
  metrics/        the metrics program: the base, the runtime's stats, supervise and pair
  measure/        measuring a running server: the base
  provision/      the roles' provisioning tools: the base and supervise's state files
  ops/            the host programs' old module paths (one release): the host-program rooms
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the import reader the structure drawing uses too (.ci/structure.py): one reading of the code
_spec = importlib.util.spec_from_file_location("structure", ROOT / ".ci" / "structure.py")
assert _spec is not None and _spec.loader is not None
structure = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(structure)
imports = structure.imports
PACKAGE = ROOT / "sparkple"
SUBPACKAGES = (
    "builder",
    "measure",
    "metrics",
    "ops",
    "pair",
    "patch",
    "provision",
    "runtime",
    "serving",
    "supervise",
    "vllm",
)
BASE = ""
# layer -> the layers it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    BASE: set(),
    "runtime": {BASE},
    "builder": {BASE, "runtime"},
    "serving": {BASE, "builder"},
    "patch": {BASE},
    "vllm": {BASE, "runtime"},
    "supervise": {BASE, "runtime"},
    "pair": {BASE, "serving", "supervise"},
    "metrics": {BASE, "runtime", "supervise", "pair"},
    "measure": {BASE},
    "provision": {BASE, "supervise"},
    "ops": {"supervise", "pair", "metrics", "provision"},
}
# layer -> the third-party packages its modules may import (anywhere in them); the runtime's
# torch and triton are imported where a step needs them, never by `sparkple build-table`
THIRD_PARTY: dict[str, set[str]] = {
    BASE: {"huggingface_hub"},  # `sparkple snapshot-manifest`, imported when it runs
    "runtime": {"numpy", "torch", "triton"},
    "builder": {"numpy"},
    "serving": set(),
    "patch": {"jinja2", "yaml"},
    # the serving process's: vLLM and its torch
    "vllm": {"numpy", "torch", "vllm"},
    # the host programs run on the host's python3 with nothing installed
    "supervise": set(),
    # pair-check's measurement only, imported when it runs in the serving image; the module
    # stays standard-library on import (tests/pair/test_linkbench.py), as host programs need
    "pair": {"torch"},
    "metrics": set(),
    # matplotlib: the benchmark report's plot (the `bench` extra), imported when it draws;
    # vllm: vLLM's own serving benchmark (vllm_bench), run by a Python that has vLLM
    "measure": {"matplotlib", "vllm"},
    "provision": set(),
    "ops": set(),
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SUBPACKAGES else BASE


def wrong_way(module: str, names: list[str]) -> list[str]:
    """The sparkple modules among `names` that `module`'s layer may not import."""
    layer = layer_of(module)
    return sorted(
        name
        for name in names
        if name.split(".")[0] == "sparkple"
        and layer_of(name) != layer
        and layer_of(name) not in ALLOWED[layer]
    )


MODULES = sorted(PACKAGE.rglob("*.py"))


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_the_layers_are_found() -> None:
    layers = {layer_of(module_name(p)) for p in MODULES}
    assert layers == set(ALLOWED)
    assert {p.parent.name for p in MODULES if p.parent != PACKAGE} == set(SUBPACKAGES)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_run_one_way(path: Path) -> None:
    module = module_name(path)
    wrong = wrong_way(module, imports(path))
    assert not wrong, f"{module} ({layer_of(module) or 'base'}) imports {wrong}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_each_layer_imports_only_what_its_python_has(path: Path) -> None:
    layer = layer_of(module_name(path))
    foreign = sorted(
        {
            name.split(".")[0]
            for name in imports(path)
            if name.split(".")[0] not in sys.stdlib_module_names | {"sparkple", "__future__"}
        }
        - THIRD_PARTY[layer]
    )
    assert not foreign, f"{module_name(path)} ({layer or 'base'}) imports {foreign}"


def test_the_checker_sees_a_wrong_way_import(tmp_path: Path) -> None:
    """Relative imports resolve to the module they name, and an upward one is caught."""
    runtime = tmp_path / "sparkple" / "runtime"
    runtime.mkdir(parents=True)
    (runtime / "bad.py").write_text(
        "from .. import errors\nfrom ..builder.plan import Plan\nfrom .table import open_table\n"
        "def later():\n    import sparkple.serving.recipe\n"
    )
    names = imports(runtime / "bad.py", tmp_path)
    assert names == [
        "sparkple.errors",
        "sparkple.builder.plan",
        "sparkple.runtime.table",
        "sparkple.serving.recipe",
    ]
    assert wrong_way("sparkple.runtime.bad", names) == [
        "sparkple.builder.plan",
        "sparkple.serving.recipe",
    ]
    (runtime / "__init__.py").write_text("from .table import open_table\n")
    assert imports(runtime / "__init__.py", tmp_path) == ["sparkple.runtime.table"]
