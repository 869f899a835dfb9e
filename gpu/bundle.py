"""vLLM's Python sources from the wheel, and the air-gapped GPU-check archive.

Usage:
  python gpu/bundle.py sources             vLLM's Python sources from the cached wheel (no
                                           compiled ops, the stand-ins for those the CUDA
                                           path imports), once; prints where
  python gpu/bundle.py build [--target T] [--python PY] [--out FILE]
                                           the archive; its path is the last line printed

The vLLM release is the default patch profile's (`sparkple.patch.DEFAULT_PROFILE`; its
version is `harness.wheel_cache.VLLM_VERSION`), and the patch rendered is that profile. The
archive (`sparkple-gpu-check/`, under 60 MiB) holds the project's files, `gpu-check.sh` at
its root, and under bundle/: that release's Python sources, the rendered patch files, the
pure-Python packages the checks import that torch does not bring (copied from where PY, the
release's vLLM test venv by default, finds them: its own site-packages or the shared base's
it reads behind it; the import smoke test finds them on the CPU and the CUDA path),
wheels/: the target's wheels of the compiled packages the checks import that the target
lacks, or has in a version the imported packages do not accept (with the pure ones pinned
to them), carried.json (what is carried, and what each carried package must satisfy, for
gpu/carried.py to choose the machine's copy or the bundle's), and needs.json: every
compiled package the checks import, carried or the machine's own.

A target is a file in gpu/targets/ (by name: the machine's architecture, Python and glibc,
and what its image has) or ARCH-pyX.Y (a machine with only torch, triton and numpy).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from harness.wheel_cache import (  # noqa: E402
    VLLM_VERSION,
    WHEEL_DIR,
    extract_once,
    locked,
    vllm_venv,
    vllm_wheel,
)
from sparkple.patch import DEFAULT_PROFILE  # noqa: E402

MIB = 1024**2
MAX_BYTES = 60 * MIB
NAME = "sparkple-gpu-check"
# What the checks read of the wheel: the Python files and the metadata (not the compiled ops,
# the kernels' configs, the Rust front end).
WHEEL_PARTS = (".py", "py.typed", ".dist-info/METADATA", ".dist-info/entry_points.txt")
# Python stand-ins for the compiled vLLM modules the CUDA platform imports unguarded, laid
# into the sources' vllm package (each file says why it is there).
STANDINS = REPO / "gpu" / "standins"
# Found next to torch on any machine that runs the checks (triton ships with CUDA torch).
WITH_TORCH = {"torch", "triton", "sparkple", "vllm"}
TARGETS = REPO / "gpu" / "targets"
DEFAULT_TARGET = "h200-offline"
# Compiled packages never carried: each must be the machine's own (the preamble says so).
NOT_CARRIED = {
    "torchvision": "it is built for one torch release and must match the machine's",
    "opencv-python-headless": "its wheel is about 50 MB, too big to carry",
    "opencv-python": "its wheel is about 60 MB, too big to carry",
}


@dataclass(frozen=True)
class Target:
    """The machine a bundle is for: what pip downloads wheels for, and what it already has."""

    name: str
    arch: str
    python: str
    glibc: str
    has: frozenset[str]  # canonical distribution names
    # {canonical name: version} of those whose version the target file gives (name==version)
    versions: dict[str, str] = field(default_factory=dict)

    @classmethod
    def named(cls, spec: str) -> Target:
        """gpu/targets/SPEC.toml, or ARCH-pyX.Y: a machine with only what the check cannot do
        without (CUDA torch with what it requires, triton, numpy) and a glibc of at least 2.35
        (Ubuntu 22.04; DGX OS, Ubuntu 24.04, has 2.39)."""
        path = TARGETS / f"{spec}.toml"
        if path.is_file():
            data = tomllib.loads(path.read_text())
            has = [Requirement(r) for r in data["has"]]
            versions = {
                str(canonicalize_name(r.name)): next(iter(r.specifier)).version
                for r in has
                if len(r.specifier) == 1 and next(iter(r.specifier)).operator == "=="
            }
            names = frozenset(canonicalize_name(r.name) for r in has)
            return cls(spec, data["arch"], data["python"], data["glibc"], names, versions)
        match = re.fullmatch(r"(x86_64|aarch64)-py(3\.\d+)", spec)
        if match is None:
            known = ", ".join(sorted(p.stem for p in TARGETS.glob("*.toml")))
            raise SystemExit(
                f"gpu-bundle: unknown target {spec!r}: name one of gpu/targets/ ({known}) "
                "or ARCH-pyX.Y with ARCH x86_64 or aarch64, e.g. aarch64-py3.12"
            )
        arch, python = match.groups()
        return cls(spec, arch, python, "2.35", frozenset({"torch", "triton", "numpy"}))

    def pip_args(self) -> list[str]:
        """pip download's selection of this target's wheels: its CPython, and every manylinux
        tag its glibc runs (pip matches each tag exactly)."""
        major, minor = (int(x) for x in self.glibc.split("."))
        tags = [f"manylinux_{major}_{n}_{self.arch}" for n in range(17, minor + 1)]
        tags += [f"manylinux2014_{self.arch}"]
        platforms = [arg for tag in tags for arg in ("--platform", tag)]
        return ["--only-binary=:all:", "--implementation", "cp",
                "--python-version", self.python, *platforms]  # fmt: skip

    def describe(self) -> dict:
        return {"name": self.name, "arch": self.arch, "python": self.python, "glibc": self.glibc}


def extract_sources(wheel: Path) -> Path:
    """The wheel's vllm package without compiled parts, with the stand-ins for the compiled
    modules the CUDA platform imports, and its metadata (a cache entry)."""
    standins = sorted(STANDINS.rglob("*.py"))

    def wanted(member: str) -> bool:
        top = member.split("/", 1)[0]
        package = top == "vllm" or top == f"vllm-{VLLM_VERSION}.dist-info"
        return package and member.endswith(WHEEL_PARTS)

    def add_standins(dest: Path) -> None:
        for standin in standins:
            shutil.copy2(standin, dest / "vllm" / standin.relative_to(STANDINS))

    recipe = str(WHEEL_PARTS) + "".join(
        f"\n{p.relative_to(STANDINS)}\n{p.read_text()}" for p in standins
    )
    return extract_once(wheel, "vllm-python", wanted, recipe, add_standins)


def run(cmd: list[str], **kwargs) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if proc.returncode:
        raise SystemExit(f"gpu-bundle: {' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout


@dataclass
class Plan:
    """What the bundle carries for a target, from the distributions the checks import."""

    copy: list[str]  # pure-Python distributions, copied from where PY finds them
    wheels: list[str]  # name==version: the target's wheels, carried
    needs: dict[str, dict]  # module: {requirement, carried, why}: every compiled one


def plan(dists: dict[str, dict], target: Target) -> Plan:
    """Pure packages are copied; compiled ones (and pure ones that pin a compiled one, as
    pydantic pins pydantic-core: a copy would not match the machine's compiled half) are
    carried as the target's wheels unless the target has them or they cannot be carried. A
    target's copy whose version the target file gives must meet what the imported packages
    require of it (vLLM 0.34.0 needs tokenizers >=0.23.3): else the wheel is carried too, and
    gpu/carried.py chooses between the two on the machine (those never carried aside: the
    target's torchvision is its torch's, whatever vLLM pins)."""
    compiled = {canonicalize_name(name) for name, d in dists.items() if d["compiled"]}
    requires = requirements_on(dists)
    result = Plan([], [], {})
    for name, dist in sorted(dists.items()):
        key = canonicalize_name(name)
        if dist["with_torch"] or key in WITH_TORCH:
            continue
        if not (dist["compiled"] or compiled & set(dist["pins"])):
            result.copy.append(name)
            continue
        requirement = f"{name}=={dist['version']}"
        has = target.versions.get(key)
        unmet = [
            f"{requirer} needs {spec}"
            for requirer, spec in requires.get(key, [])
            if has is not None and not SpecifierSet(spec).contains(has, prereleases=True)
        ]
        if key in target.has and unmet and key not in NOT_CARRIED:
            why = f"carried as the {target.name} wheel: the target's {has} does not meet"
            need = {"carried": True, "why": f"{why} {'; '.join(unmet)}"}
            result.wheels.append(requirement)
        elif key in target.has:
            need = {"carried": False, "why": f"the target ({target.name}) has it"}
        elif key in NOT_CARRIED:
            need = {"carried": False, "why": f"not carried: {NOT_CARRIED[key]}"}
        else:
            need = {"carried": True, "why": f"carried as the {target.name} wheel"}
            result.wheels.append(requirement)
        result.needs[dist["modules"][0]] = {"requirement": requirement, **need}
    return result


def wheel_for(directory: Path, requirement: str) -> Path | None:
    name, version = requirement.split("==")
    for wheel in sorted(directory.glob("*.whl")):
        wheel_name, wheel_version = wheel.name.split("-")[:2]
        if canonicalize_name(wheel_name) == canonicalize_name(name) and wheel_version == version:
            return wheel
    return None


def target_wheels(requirements: list[str], target: Target) -> list[Path]:
    """The target's wheels of requirements (name==version), downloaded once per machine into
    the cache (pip writes each under a temporary name and renames it)."""
    directory = WHEEL_DIR / f"gpu-{target.arch}-py{target.python}-glibc{target.glibc}"
    with locked(directory.name):
        directory.mkdir(parents=True, exist_ok=True)
        missing = [r for r in requirements if wheel_for(directory, r) is None]
        if missing:
            pip = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check"]
            run([*pip, "--no-deps", *target.pip_args(), "-d", str(directory), *missing])
    wheels = {r: wheel_for(directory, r) for r in requirements}
    absent = [r for r, wheel in wheels.items() if wheel is None]
    if absent:
        raise SystemExit(f"gpu-bundle: pip left no {target.name} wheel of {' '.join(absent)}")
    return [wheel for wheel in wheels.values() if wheel is not None]


def runner_dists() -> dict[str, dict]:
    """pytest and what it requires, from this interpreter (the gpu-marked tests run with it;
    all pure Python): {name: {version, site, files, requires}}."""
    import importlib.metadata

    found: dict[str, dict] = {}
    todo = ["pytest"]
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        name = dist.metadata["Name"]
        if name in found:
            continue
        requires = dist.requires or []
        files = [str(f) for f in dist.files or [] if not str(f).startswith("..")]
        if any(f.endswith((".so", ".pyd")) for f in files):
            raise SystemExit(f"gpu-bundle: {name}, which pytest needs, is compiled here")
        found[name] = {
            "version": dist.version,
            "site": str(dist.locate_file("")),
            "files": files,
            "requires": [r for r in requires if ";" not in r],
        }
        for text in requires:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def requirements_on(dists: dict[str, dict]) -> dict[str, list[list[str]]]:
    """{distribution: [[requirer, specifier], ...]}: what the imported distributions require
    of each other, unconditionally (for gpu/carried.py's choice of a machine's own copy)."""
    found: dict[str, list[list[str]]] = {}
    for requirer, dist in sorted(dists.items()):
        for text in dist["requires"]:
            requirement = Requirement(text)
            if requirement.marker is None and str(requirement.specifier):
                entry = [requirer, str(requirement.specifier)]
                found.setdefault(canonicalize_name(requirement.name), []).append(entry)
    return found


def project_files() -> list[str]:
    out = run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO)
    return [path for path in out.splitlines() if (REPO / path).is_file()]


def build(python: str, out: Path, target: Target) -> Path:
    wheel = vllm_wheel()
    sources = extract_sources(wheel)
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / NAME
        for rel in project_files():
            (stage / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, stage / rel)
        shutil.copy2(REPO / "gpu" / "gpu-check.sh", stage / "gpu-check.sh")
        bundle = stage / "bundle"
        shutil.copytree(sources, bundle / "vllm-src", ignore=shutil.ignore_patterns(".complete"))
        rendered = bundle / "rendered"
        run(
            [sys.executable, "-m", "sparkple.cli", "patch", "render", "--profile", DEFAULT_PROFILE,
             "--originals", str(sources / "vllm"), "--out", str(rendered)],
            cwd=REPO,
        )  # fmt: skip
        # what the checks import, found by importing it with PY and the archive's vLLM
        # sources, as the bundle runs (PY's own vLLM may need a driver): the CPU platform's
        # imports and the CUDA path's (import_smoke.py's cuda-path)
        dists_path = Path(tmp) / "dists.json"
        path = f"{REPO}:{bundle / 'vllm-src'}"
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": path}
        smoke = [python, str(REPO / "gpu" / "import_smoke.py"), "cpu", str(rendered)]
        run([*smoke, str(dists_path)], env=env, cwd=tmp)
        dists = json.loads(dists_path.read_text())
        carry = plan(dists, target)
        # the gpu-marked tests' runner too, where the checks' own imports did not bring it
        imported = {canonicalize_name(k) for k in dists}
        runner = {n: d for n, d in runner_dists().items() if canonicalize_name(n) not in imported}
        dists.update(runner)
        carried: dict[str, dict] = {}
        for name in [*carry.copy, *runner]:
            # each from where PY found it: its venv's site-packages, or the one it reads behind
            # it (a vLLM test venv holds vLLM alone over the shared base's packages)
            source_site = Path(dists[name]["site"])
            files = []
            for rel in dists[name]["files"]:
                source = source_site / rel
                if source.is_file() and "__pycache__" not in rel:
                    (bundle / "site" / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(source, bundle / "site" / rel)
                    files.append(rel)
            carried[name] = {"version": dists[name]["version"], "site": files}
        (bundle / "wheels").mkdir()
        for requirement, wheel in zip(
            carry.wheels, target_wheels(carry.wheels, target), strict=True
        ):
            shutil.copy2(wheel, bundle / "wheels" / wheel.name)
            name, version = requirement.split("==")
            carried[name] = {"version": version, "wheel": f"wheels/{wheel.name}"}
        requires = requirements_on(dists)
        for name, entry in carried.items():
            entry["requires"] = requires.get(canonicalize_name(name), [])
        manifest = {"target": target.describe(), "packages": carried}
        (bundle / "carried.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
        (bundle / "needs.json").write_text(json.dumps(carry.needs, indent=2, sort_keys=True))
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:gz", compresslevel=6) as archive:  # 9: as small, 2.5x the CPU
            archive.add(stage, arcname=NAME)
    size = out.stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"gpu-bundle: {out} is {size / MIB:.1f} MiB, above {MAX_BYTES // MIB}")
    print(
        f"gpu-bundle: for {target.name}: {len(carry.copy)} pure-Python packages copied (and "
        f"the test runner: {' '.join(sorted(runner)) or 'none needed'}), "
        f"{len(carry.wheels)} wheels carried ({' '.join(carry.wheels)}), "
        f"{len(carry.needs) - len(carry.wheels)} compiled ones the machine's own"
    )
    print(f"gpu-bundle: {size / MIB:.1f} MiB")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu/bundle.py")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("sources")
    b = sub.add_parser("build")
    b.add_argument("--python", help="default: the vLLM test venv (built when missing)")
    b.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help=f"a file of gpu/targets/ by name, or ARCH-pyX.Y (default {DEFAULT_TARGET})",
    )
    b.add_argument("--out", type=Path, default=REPO / ".cache" / "gpu-bundle" / f"{NAME}.tar.gz")
    args = parser.parse_args(argv)
    if args.command == "sources":
        print(extract_sources(vllm_wheel()))
        return 0
    target = Target.named(args.target)
    python = args.python or str(vllm_venv())
    if not Path(python).exists():
        print(
            f"gpu-bundle: no Python at {python}: pass --python with vLLM {VLLM_VERSION}",
            file=sys.stderr,
        )
        return 2
    print(build(python, args.out.resolve(), target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
