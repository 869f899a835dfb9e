"""The CUDA-graph check: its CPU smoke mode here, the whole check where a GPU is."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name
from skip_guard import skip_without_cuda

from harness import wheel_cache
from sparkple import patch
from sparkple.builder.build import build_table
from sparkple.builder.synth import synth_checkpoint

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "harness" / "gpu_graph_check.py"
MIB = 1024**2
# what a machine without network sees: no index, no hub, every proxied connection refused
OFFLINE = {
    "PIP_NO_INDEX": "1",
    "HF_HUB_OFFLINE": "1",
    "http_proxy": "http://127.0.0.1:9",
    "https_proxy": "http://127.0.0.1:9",
}
SHAPES = ("1", "8", "16", "2048")
MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE", "NONE")


def run_graph_check(vllm_venv: Path, vllm_originals: Path, work: Path, device: str, vocab: int):
    snapshot = synth_checkpoint(work / "snapshot", quant="nvfp4", vocab_base=vocab, files=2)
    table = work / "table"
    build_table(snapshot, table, quiet=True)
    rendered = work / "rendered"
    patch.render(patch.DEFAULT_PROFILE, vllm_originals, rendered)
    out = work / "graph.json"
    env = {**os.environ, "PYTHONPATH": wheel_cache.pythonpath(REPO)}
    env.pop("SPARKPLE_PLE_TABLE_DIR", None)
    args = [str(vllm_venv), str(SCRIPT), device, str(rendered), str(out), f"{snapshot}={table}"]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=work)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return json.loads(out.read_text()), proc.stdout


def assert_honest_checks(result: dict) -> None:
    checks = result["checks"]
    assert len(checks["replays"]) == 6
    for replay in checks["replays"]:
        assert replay == {
            "equals_stock": True,
            "nonzero": True,
            "padding_zero": True,
            "differs_from_previous": True,
        }
    assert checks["zero_rows_replay_zero"]
    assert checks["sizes"] == {"1": True, "8": True, "16": True, "2048": True}
    # decode tokens and MTP drafts come from the device (one wait); a prompt chunk never waits
    assert checks["syncs"] == {
        "1": {"synced": True, "expected": True},
        "8": {"synced": True, "expected": True},
        "16": {"synced": True, "expected": True},
        "2048": {"synced": False, "expected": False},
    }
    assert result["ok"] and result["failed"] == []


def assert_timed_shapes(result: dict, executions: dict[str, set[str]]) -> None:
    host_side = result["host_side"]
    assert tuple(host_side) == SHAPES
    for tokens, shape in host_side.items():
        assert set(shape["by_execution"]) == executions[tokens]
        for temps in shape["by_execution"].values():
            for figures in (temps["cold"], temps["warm"]):
                assert 0 < figures["host_side_ms"] <= figures["step_ms"]
                assert figures["gather_wait_ms"] >= 0
        assert tuple(shape["modes"]) == MODES
    # what vLLM (0.33 and 0.34) runs for one layer: FULL graphs for uniform decode, piecewise graphs
    # (the same capture for one layer) for mixed steps, eager beyond the largest capture size
    assert host_side["16"]["modes"] == {
        "FULL_AND_PIECEWISE": "full",
        "FULL_DECODE_ONLY": "full",
        "PIECEWISE": "piecewise",
        "NONE": "eager",
    }
    assert set(host_side["2048"]["modes"].values()) == {"eager"}


# the step sizes timed and how each is run (2,048 tokens exceed the largest captured graph)
TIMED_SHAPES = {
    "1": {"eager", "graph"},
    "8": {"eager", "graph"},
    "16": {"eager", "graph"},
    "2048": {"eager"},
}


@pytest.mark.gpu
def test_graph_check_on_cuda(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The same check with FULL CUDA graphs against stock vLLM's pinned-host lookup."""
    skip_without_cuda()  # first: on a CPU machine that is the one reason it skips
    vllm_venv = request.getfixturevalue("vllm_venv")
    vllm_originals = request.getfixturevalue("vllm_originals")
    result, _ = run_graph_check(vllm_venv, vllm_originals, tmp_path, "cuda", vocab=60_000)
    # an installed vLLM (vllm._C): stock vLLM's pinned-host lookup is the reference; vLLM's
    # Python sources alone (the bundle's): its device backend, the same Triton lookup
    sources_only = wheel_cache.given_sources() is not None
    assert result["stock_backend"] == (
        "Qwen4ExpPLEDeviceEmbedding" if sources_only else "Qwen4ExpPLEPinnedHostEmbedding"
    )
    assert result["patched_backend"] == "Qwen4ExpPLEPackedTableEmbedding"
    assert result["staging_pinned"] and result["host_inputs_pinned"]
    assert_honest_checks(result)
    assert_timed_shapes(result, TIMED_SHAPES)


def gpu_module(name: str):
    """gpu/NAME.py as a module (gpu/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", REPO / "gpu" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def preamble():
    return gpu_module("preamble")


def without_nvidia_smi(tmp_path: Path) -> dict[str, str]:
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi")
    return {**os.environ, "GPU_CHECK_OUT": str(tmp_path / "out")}


def test_gpu_check_runs_every_gpu_marked_test_file() -> None:
    """gpu-check.sh's list of test files holds every file with a gpu-marked test (the skip
    guard's own cases in tests/ci aside: they mark tests gpu to test the guard)."""
    script = (REPO / "gpu" / "gpu-check.sh").read_text()
    listed = re.search(r"^gpu_tests=\(\n(.*?)\n\)", script, re.S | re.M)
    assert listed is not None
    marked = {
        str(path.relative_to(REPO))
        for path in (REPO / "tests").rglob("test_*.py")
        if "pytest.mark.gpu" in path.read_text() and path.parent.name != "ci"
    }
    assert set(listed.group(1).split()) == marked


def test_gpu_check_without_a_gpu_exits_2_at_once(tmp_path: Path) -> None:
    """One line, exit 2, within seconds, before anything is built, rendered or downloaded."""
    env = without_nvidia_smi(tmp_path)
    for cmd in (["bash", ".ci/gpu-check"], ["make", "-s", "gpu-check"]):
        started = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
        assert time.monotonic() - started < 60
        assert proc.returncode == 2
        assert proc.stderr.splitlines()[0] == (
            "gpu-check: no NVIDIA GPU here (nvidia-smi -L failed): run it on a machine with one"
        )
        assert proc.stdout == ""
    assert not (tmp_path / "out").exists()


def fake_nvidia_smi(bin_dir: Path) -> None:
    """An nvidia-smi that answers like a machine with one GPU (torch still sees none)."""
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in -L) echo "GPU 0: Fake GPU (UUID: GPU-0)";; '
        '*) echo "Fake GPU, 580.1";; esac\n'
    )
    script.chmod(0o755)


def test_preamble_refuses_a_torch_without_cuda(tmp_path: Path) -> None:
    # the test runner's own Python has the CPU build of torch (the vLLM venv has a CUDA one)
    fake_nvidia_smi(tmp_path / "bin")
    env = {
        **os.environ,
        **OFFLINE,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "GPU_CHECK_OUT": str(tmp_path / "out"),
    }
    proc = subprocess.run(
        ["bash", ".ci/gpu-check"], capture_output=True, text=True, env=env, cwd=REPO
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1].startswith(
        "gpu-check: torch 2.13.0+cpu is a build without CUDA: set PYTHON to a Python with CUDA"
    )


def test_preamble_refuses_pythons_outside_the_wheels_range() -> None:
    """The range and the torch pin are the default release's wheel's METADATA's."""
    module = preamble()
    wheel = wheel_cache.vllm_wheel()
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"vllm-{wheel_cache.VLLM_VERSION}.dist-info/METADATA").decode()
    release = module.Release.parse(metadata)
    (torch_pin,) = wheel_cache.wheel_pins(wheel, ("torch",))
    assert release == module.Release(
        wheel_cache.VLLM_VERSION, ">=3.11, <3.15", torch_pin.split("==")[1]
    )
    for version in ((3, 11), (3, 14)):
        module.check_python(version, release)
    message = rf"outside vLLM {re.escape(wheel_cache.VLLM_VERSION)}'s range \(>=3.11, <3.15\)"
    for version in ((3, 10), (3, 15)):
        with pytest.raises(module.Refusal, match=message):
            module.check_python(version, release)
    other = module.Release.parse("Version: 9.1\nRequires-Python: >3.12,!=3.13.*\n")
    assert (other.requires_python, other.torch_pin) == (">3.12, !=3.13.*", None)
    allowed = [v for v in ((3, 12), (3, 13), (3, 14)) if other.python_allows(v)]
    assert allowed == [(3, 14)]  # 3.12 is 3.12.0, not above 3.12


def test_preamble_names_the_compiled_packages_missing() -> None:
    module = preamble()
    here = {"requirement": "json==0", "carried": False, "why": "the target (t) has it"}
    module.check_needs({"json": here, "sys": here})
    missing = {
        "sparkple_nothere": {"requirement": "nothere==1.0", "carried": False,
                             "why": "not carried: too big"},
        "sparkple_nothere2": {"requirement": "nothere2==2", "carried": False,
                              "why": "the target (t) has it"},
    }  # fmt: skip
    with pytest.raises(module.Refusal) as info:
        module.check_needs(missing)
    assert str(info.value).startswith(
        "this Python lacks compiled packages the checks import: nothere==1.0 (not carried: too "
        "big); nothere2==2 (the target (t) has it): add them"
    )
    assert "pip install" not in str(info.value)  # the bundle's machine is offline


def test_the_sources_import_vllms_cuda_platform_and_its_standin_refuses_use(
    tmp_path: Path, vllm_venv: Path
) -> None:
    """vllm/platforms/cuda.py imports the compiled vllm._C_stable_libtorch with no guard: the
    wheel's Python files alone stop there; with the stand-in they import, and any use of the
    stand-in raises and is logged (the bundle's smoke run below logs none)."""
    bundle = gpu_module("bundle")
    sources = Path(bundle.extract_sources(bundle.vllm_wheel()))
    log = tmp_path / "standin.log"
    env = {**os.environ, "PYTHONPATH": str(sources), "VLLM_TARGET_DEVICE": "cpu"}
    env["SPARKPLE_STANDIN_LOG"] = str(log)
    imports = "import vllm.platforms.cuda, vllm._C_stable_libtorch as c; print(c.STANDIN)"
    proc = subprocess.run(
        [str(vllm_venv), "-c", imports], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0 and proc.stdout == "True\n", proc.stderr[-3000:]
    assert not log.exists()  # importing it uses nothing
    use = "import vllm._C_stable_libtorch as c; c.silu_and_mul"
    proc = subprocess.run(
        [str(vllm_venv), "-c", use], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert proc.returncode == 1
    assert "is the GPU check's stand-in for vLLM's compiled ops: 'silu_and_mul'" in proc.stderr
    assert log.read_text() == "refused vllm._C_stable_libtorch.silu_and_mul\n"
    # without the stand-in, the same import stops at the compiled module
    bare = tmp_path / "bare"
    shutil.copytree(sources, bare, ignore=shutil.ignore_patterns("_C_stable_libtorch.py"))
    proc = subprocess.run(
        [str(vllm_venv), "-c", "import vllm.platforms.cuda"],
        capture_output=True, text=True, env={**env, "PYTHONPATH": str(bare)}, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "No module named 'vllm._C_stable_libtorch'" in proc.stderr


# The reference offline GPU machine (gpu/targets/): the compiled packages the check imports
# (vLLM 0.34.0's sources) that its image lacks, which the bundle must carry as its wheels
# (pydantic with them: it pins pydantic-core), and those its image has in a version below
# what vLLM requires (the target's version), carried too.
TARGET = REPO / "gpu" / "targets" / "h200-offline.toml"
REFERENCE_LACKS = {
    "apache-tvm-ffi", "cbor2", "llguidance", "msgspec", "pybase64", "pydantic", "pydantic-core",
    "pyzmq", "xgrammar",
}  # fmt: skip
REFERENCE_TOO_OLD = {"tokenizers": ("0.23.2", "vllm needs >=0.23.3")}


@pytest.fixture(scope="session")
def machine_python() -> Path:
    """The simulated offline GPU machine: a venv of the target's Python (3.12) with torch
    2.11.0, triton 3.6.0 and what the target's image has of the check's needs, no more."""
    return wheel_cache.machine_venv(TARGET)


def test_bundle_runs_on_the_simulated_offline_gpu_machine(
    vllm_venv: Path, machine_python: Path, tmp_path: Path
) -> None:
    """make gpu-bundle's archive for the reference machine: under 60 MiB, its path the last
    line, the target's wheels of the 9 compiled packages the machine lacks and of the one it
    has too old for vLLM 0.34.0 (tokenizers), and huggingface_hub 2.x. Unpacked in a new
    folder, with no network (a new network namespace: loopback only), its gpu-check.sh
    --cpu-smoke passes on the simulated machine: the preamble, the carried packages laid out
    (each from the bundle or the machine, and why), the CUDA path's imports up to the first
    device call, and every check. Nothing of the stand-ins is used but vLLM's import-time
    CUTLASS query."""
    archive = tmp_path / "gpu-check.tar.gz"
    cmd = [sys.executable, "gpu/bundle.py", "build", "--target", TARGET.stem,
           "--python", str(vllm_venv), "--out", str(archive)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == str(archive)
    assert archive.stat().st_size < 60 * MIB
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    root = tmp_path / "unpacked" / "sparkple-gpu-check"
    # the check scripts gpu-check.sh runs, and the harness they import, are carried
    for script in ("__init__.py", "gpu_graph_check.py", "gpu_host_split.py", "gpu_disk_offload.py",
                   "ple_equivalence.py"):  # fmt: skip
        assert (root / "harness" / script).is_file(), script
    carried = json.loads((root / "bundle" / "carried.json").read_text())
    assert carried["target"] == {"name": "h200-offline", "arch": "x86_64", "python": "3.12",
                                 "glibc": "2.35"}  # fmt: skip
    wheels = {canonicalize_name(n) for n, p in carried["packages"].items() if "wheel" in p}
    assert wheels == REFERENCE_LACKS | set(REFERENCE_TOO_OLD)
    needs = json.loads((root / "bundle" / "needs.json").read_text())
    assert {canonicalize_name(n["requirement"].split("==")[0]) for n in needs.values()
            if n["carried"]} == REFERENCE_LACKS | set(REFERENCE_TOO_OLD)  # fmt: skip
    for name, (version, unmet) in REFERENCE_TOO_OLD.items():
        assert needs[name]["why"] == (
            f"carried as the h200-offline wheel: the target's {version} does not meet {unmet}"
        )
    # vLLM pins another torchvision, but a machine's torchvision is its torch's own
    assert needs["torchvision"]["why"] == "the target (h200-offline) has it"
    # the vLLM release's sources and its rendered profile
    assert (root / "bundle" / "vllm-src" / f"vllm-{wheel_cache.VLLM_VERSION}.dist-info").is_dir()
    manifest = json.loads((root / "bundle" / "rendered" / "manifest.json").read_text())
    assert manifest["profile"] == patch.DEFAULT_PROFILE
    # vLLM 0.34.0 needs huggingface_hub >=2 (the target has 1.33.0): a pure copy is carried
    assert carried["packages"]["huggingface_hub"]["version"].startswith("2.")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GPU_CHECK_OUT")}
    log = tmp_path / "standin.log"
    env.update(OFFLINE, PYTHON=str(machine_python), SPARKPLE_STANDIN_LOG=str(log))
    offline = "ip link set lo up && exec bash gpu-check.sh --cpu-smoke"
    proc = subprocess.run(
        ["unshare", "--net", "bash", "-c", offline], capture_output=True, text=True, env=env,
        cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = root / "gpu-check-results"
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["preamble"]["python"].startswith("3.12.")
    assert (
        report["preamble"]["torch"].startswith("2.11.0") and report["preamble"]["triton"] == "3.6.0"
    )
    assert report["preamble"]["vllm_file"].startswith(str(root / "bundle" / "vllm-src"))
    assert report["ok"] and report["checks"]["graph"]["ok"] and report["checks"]["host_split"]["ok"]
    # the graph check's smoke mode built the check's vLLM config (the Engram config a Qwen4Exp
    # server resolves, validated by VllmConfig), both layers, vLLM's model state and dummy
    # inputs, then ran the same steps eagerly: a crash before the first CUDA call fails here
    graph = json.loads((out / "graph.json").read_text())
    assert "cpu_offload=True" in graph["engram_config"]
    assert graph["stock_backend"] == "Qwen4ExpPLEDeviceEmbedding"
    assert graph["patched_backend"] == "Qwen4ExpPLEPackedTableEmbedding"
    assert_honest_checks(graph)
    assert_timed_shapes(graph, TIMED_SHAPES)
    assert "\n".join(graph["summary"]) in proc.stdout
    assert "all checks passed" in graph["summary"][0]
    # the host-split check up to its first CUDA call: the step shapes run through vLLM's model
    # state; a prompt chunk alone does not wait for the device, the others do, and every
    # shape's rows equal stock's (whether the host step waited is seen through its wait)
    split = json.loads((out / "host_split.json").read_text())
    assert split["device"] == "cpu" and split["ok"], split["summary"]
    steps = split["steps"]
    assert list(steps) == ["prompt chunk", "decode, MTP 3", "chunk beside decodes"]
    assert not steps["prompt chunk"]["waited_for_the_device"]
    assert steps["decode, MTP 3"]["waited_for_the_device"]
    assert steps["chunk beside decodes"]["waited_for_the_device"]
    for seen in steps.values():
        assert seen["rows_equal_stock"]
        assert seen["before_sync_us"] > 0 and seen["after_sync_us"] >= 0
    # vLLM 0.34's disk offload against the packed table, step kind by step kind: the same rows
    offload = json.loads((out / "disk_offload.json").read_text())
    assert offload["ok"], offload
    assert list(offload["kinds"]) == ["decode@1", "decode@8", "mtp 4x4", "prompt chunk"]
    assert all(kind["staged_equal"] for kind in offload["kinds"].values())
    # the machine lacks them, so the bundle's copies are used, and the report says which
    used = json.loads((out / "carried.json").read_text())
    assert set(used) == set(carried["packages"])
    for name in carried["packages"]:
        if canonicalize_name(name) in REFERENCE_LACKS:
            assert used[name] == {"used": "bundle", "version": carried["packages"][name]["version"],
                                  "why": "not on this machine"}  # fmt: skip
    # the machine has them older than the bundle's: the bundle's are used
    for name, version in [*((n, v) for n, (v, _) in REFERENCE_TOO_OLD.items()),
                          ("huggingface_hub", "1.33.0")]:  # fmt: skip
        ours = carried["packages"][name]["version"]
        why = f"this machine's {version} is older than the bundle's {ours}"
        assert used[name] == {"used": "bundle", "version": ours, "why": why}
    assert f"gpu-check: of {len(used)} carried packages, " in proc.stdout
    # the CUDA path's imports, as on the GPU, stopped where a device is needed
    cuda_line = next(line for line in proc.stdout.splitlines() if "CUDA path" in line)
    assert "vllm.platforms.cuda.CudaPlatform" in cuda_line
    assert "stopped at the first device call: Found no NVIDIA driver" in cuda_line
    assert "import smoke: vLLM platform CpuPlatform; CUDA platform module imports" in proc.stdout
    # the gpu-marked tests collect there, with the pytest the bundle carries where need be
    assert "gpu-check: the gpu-marked tests collect (" in proc.stdout
    assert "tests collected" in proc.stdout
    # vLLM's w8a8 utils ask for CUTLASS block FP8 once as they import on the CUDA path
    assert log.read_text() == "answered cutlass_scaled_mm_supports_block_fp8(90)\n"
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[-1] == "gpu-check: every check passed"
    torch_tier = report["checks"]["torch"]
    assert torch_tier["ok"] and len(torch_tier["checks"]) == 12
    assert summary[1].startswith("torch tier (cpu (smoke mode), torch 2.11.0")

    # the same bundle on another Python (the test venv's 3.11): the torch tier runs first and
    # writes its figures, then the carried wheels are refused by name (exit 2)
    (out / "torch.json").unlink()
    env["PYTHON"] = str(vllm_venv)
    proc = subprocess.run(
        ["unshare", "--net", "bash", "-c", offline], capture_output=True, text=True, env=env,
        cwd=root,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "carries wheels for x86_64 Python 3.12 (h200-offline); this is x86_64 Python 3.11" in (
        proc.stderr
    )
    assert json.loads((out / "torch.json").read_text())["ok"]


def test_the_torch_tier_catches_a_decode_that_drops_the_sign_bit(vllm_venv: Path) -> None:
    """The torch tier's decode check, run by Triton's interpreter, passes the real kernel and
    fails one that reads every code's sign bit as 0 (the old host-split comparison drew bytes
    below 0x7E: no odd element was ever negative there)."""
    snippet = (
        "import json, sys, torch\n"
        "sys.path.insert(0, 'gpu')\n"
        "import torch_tier\n"
        "from sparkple.runtime.nvfp4_triton import decode_packed_rows\n"
        "def no_sign(packed, quant, head_dim, *rest):\n"
        "    codes = packed.clone()\n"
        "    codes[..., : head_dim // 2] &= 0x77\n"
        "    return decode_packed_rows(codes, quant, head_dim, *rest)\n"
        "cpu = torch.device('cpu')\n"
        "print(json.dumps([torch_tier.check_nvfp4(cpu), torch_tier.check_nvfp4(cpu, no_sign)]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [str(vllm_venv), "-c", snippet], capture_output=True, text=True, env=env, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    real, planted = json.loads(proc.stdout.splitlines()[-1])
    assert set(real) == set(planted) and len(real) == 4
    assert all(real.values()) and not any(planted.values())


def carried_module():
    return gpu_module("carried")


def test_the_machines_own_copy_is_used_only_when_as_new_and_compatible() -> None:
    carried = carried_module()
    packages = {
        "newer": {"version": "1.0", "requires": [["vllm", ">=0.9"]]},
        "same": {"version": "2.0", "requires": []},
        "older": {"version": "3.0", "requires": []},
        "too-new": {"version": "1.0", "requires": [["vllm", "<1.5"]]},
        "absent": {"version": "1.0", "requires": []},
        "pydantic": {"version": "2.14.4", "requires": []},
        "pydantic-core": {"version": "2.50.5", "requires": []},
    }
    machine = {"newer": "1.2", "same": "2.0", "older": "2.9", "too-new": "2.0",
               "pydantic": "2.15.0"}  # fmt: skip
    pins = {"pydantic": {"pydantic-core": "==2.51.0"}}
    chosen = carried.choose(packages, machine, lambda name: pins.get(name, {}))
    assert {n: c["used"] for n, c in chosen.items()} == {
        "newer": "machine", "same": "machine", "older": "bundle", "too-new": "bundle",
        "absent": "bundle", "pydantic": "bundle", "pydantic-core": "bundle",
    }  # fmt: skip
    assert chosen["newer"]["version"] == "1.2" and chosen["older"]["version"] == "3.0"
    assert chosen["too-new"]["why"] == "this machine's 2.0 does not meet vllm needs <1.5"
    # the machine's pydantic pins a pydantic-core it lacks: both come from the bundle
    assert chosen["pydantic"]["why"] == (
        "this machine's copy needs pydantic-core==2.51.0, and 2.50.5 is used"
    )


def test_a_bundle_for_another_python_is_refused_by_name() -> None:
    carried = carried_module()
    target = {"name": "h200-offline", "arch": "x86_64", "python": "3.9", "glibc": "2.35"}
    refusal = carried.check_target(target)
    assert refusal is not None and "carries wheels for x86_64 Python 3.9 (h200-offline)" in refusal
    assert "make gpu-bundle TARGET=" in refusal
