"""vLLM 0.33.0's Python sources from the wheel, and the air-gapped GPU-check archive.

Usage:
  python gpu/bundle.py sources DEST        vLLM's Python sources from the cached wheel (no
                                           compiled ops) into DEST/vllm, once
  python gpu/bundle.py build [--python PY] [--out FILE]
                                           the archive; its path is the last line printed

The archive (`sparkple-gpu-check/`, under 60 MiB) holds the project's files, `gpu-check.sh`
at its root, and under bundle/: vLLM 0.33.0's Python sources, the rendered patch files, the
pure-Python packages the checks import that torch does not bring (copied from PY, the vLLM
test venv by default, where the import smoke test finds them), and needs.json: the compiled
packages they import, which a machine must already have (they are built per platform).
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from wheel_cache import VLLM_VERSION, extract_once, vllm_venv, vllm_wheel  # noqa: E402

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


def extract_sources(wheel: Path) -> Path:
    """The wheel's vllm package without compiled parts, with the stand-ins for the compiled
    modules the CUDA platform imports, and its metadata (a cache entry)."""
    standins = sorted(STANDINS.glob("*.py"))

    def wanted(member: str) -> bool:
        top = member.split("/", 1)[0]
        package = top == "vllm" or top == f"vllm-{VLLM_VERSION}.dist-info"
        return package and member.endswith(WHEEL_PARTS)

    def add_standins(dest: Path) -> None:
        for standin in standins:
            shutil.copy2(standin, dest / "vllm" / standin.name)

    recipe = str(WHEEL_PARTS) + "".join(f"\n{p.name}\n{p.read_text()}" for p in standins)
    return extract_once(wheel, "vllm-python", wanted, recipe, add_standins)


def run(cmd: list[str], **kwargs) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if proc.returncode:
        raise SystemExit(f"gpu-bundle: {' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def site_packages(python: str) -> Path:
    return Path(
        run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    )


def split_dists(dists: dict[str, dict]) -> tuple[list[str], dict[str, str]]:
    """(pure-Python distributions to copy, {module: requirement} the machine must have).

    A pure package that pins a compiled one (pydantic and pydantic-core) is needed as well:
    a copy would not match the machine's compiled half.
    """
    compiled = {re.sub(r"[-_.]+", "-", name).lower() for name, d in dists.items() if d["compiled"]}
    copy, needs = [], {}
    for name, dist in sorted(dists.items()):
        if dist["with_torch"] or name in WITH_TORCH:
            continue
        if dist["compiled"] or compiled & set(dist["pins"]):
            needs[dist["modules"][0]] = f"{name}=={dist['version']}"
        else:
            copy.append(name)
    return copy, needs


def project_files() -> list[str]:
    out = run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO)
    return [path for path in out.splitlines() if (REPO / path).is_file()]


def build(python: str, out: Path) -> Path:
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
            [sys.executable, "-m", "sparkple.cli", "patch", "render", "--profile", "vllm-0.33",
             "--originals", str(sources / "vllm"), "--out", str(rendered)],
            cwd=REPO,
        )  # fmt: skip
        # what the checks import, found by importing it with PY (CPU platform) and the
        # archive's vLLM sources, as the bundle runs (PY's own vLLM may need a driver)
        dists_path = Path(tmp) / "dists.json"
        path = f"{REPO}:{bundle / 'vllm-src'}"
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": path}
        smoke = [python, str(REPO / "gpu" / "import_smoke.py"), "cpu", str(rendered)]
        run([*smoke, str(dists_path)], env=env, cwd=tmp)
        copy, needs = split_dists(json.loads(dists_path.read_text()))
        site, dists = site_packages(python), json.loads(dists_path.read_text())
        for name in copy:
            for rel in dists[name]["files"]:
                source = site / rel
                if source.is_file() and "__pycache__" not in rel:
                    (bundle / "site" / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(source, bundle / "site" / rel)
        (bundle / "needs.json").write_text(json.dumps(needs, indent=2, sort_keys=True) + "\n")
        (bundle / "packages.json").write_text(
            json.dumps({name: dists[name]["version"] for name in copy}, indent=2) + "\n"
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:gz", compresslevel=9) as archive:
            archive.add(stage, arcname=NAME)
    size = out.stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"gpu-bundle: {out} is {size / MIB:.1f} MiB, above {MAX_BYTES // MIB}")
    print(f"gpu-bundle: {len(copy)} pure-Python packages, {len(needs)} compiled ones needed")
    print(f"gpu-bundle: {size / MIB:.1f} MiB")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu/bundle.py")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("sources")
    b = sub.add_parser("build")
    b.add_argument("--python", help="default: the vLLM test venv (built when missing)")
    b.add_argument("--out", type=Path, default=REPO / ".cache" / "gpu-bundle" / f"{NAME}.tar.gz")
    args = parser.parse_args(argv)
    if args.command == "sources":
        print(extract_sources(vllm_wheel()))
        return 0
    python = args.python or str(vllm_venv())
    if not Path(python).exists():
        print(f"gpu-bundle: no Python at {python}: pass --python with vLLM 0.33.0", file=sys.stderr)
        return 2
    print(build(python, args.out.resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
