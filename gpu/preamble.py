"""What the GPU check runs on, printed before anything runs, and the refusals (exit 2).

Usage: python preamble.py {cuda|cpu} RESULT_JSON [NEEDS_JSON]

Prints the GPU, its driver, the CUDA version torch was built for, and the torch, triton,
vLLM and Python versions; refuses, with one line and exit 2: a Python outside the vLLM
wheel's range, a torch that does not import, a torch without CUDA, a GPU torch cannot use
(no NVIDIA GPU, or a driver older than torch's CUDA build needs), and compiled packages the
checks import that do not import here (NEEDS_JSON, written by the bundle: those it carries,
laid on the path by carried.py, and those that must be the machine's own, each with why).
`cpu` (the smoke mode) needs torch only. Torch and triton other than vLLM's pins are
accepted and reported. Standard library only until torch is imported.

The wheel's range and torch pin are read from the METADATA of the vLLM the checks run: the
one on this Python's path (the serving image's own, or the sources gpu-check.sh puts on
PYTHONPATH, with their dist-info), else the bundle's sources beside this file. A checkout's
first run, before its sources are extracted, may find none: the range is then checked on
the second run, with the sources on the path, before anything imports vLLM.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# the bundle's vLLM sources, with their dist-info, when this file is in an unpacked bundle
BUNDLE_SOURCES = Path(__file__).resolve().parents[1] / "bundle" / "vllm-src"
EXIT_USAGE = 2
_OPERATORS = {
    ">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b,
    "<": lambda a, b: a < b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
}  # fmt: skip


class Refusal(Exception):
    """The check cannot run on this machine; the message says why and what to do."""


@dataclass(frozen=True)
class Release:
    """What the vLLM wheel's METADATA asks of the machine: its version, its Requires-Python
    (">=3.11, <3.15": the lower bounds first) and its torch pin (None where it pins none)."""

    version: str
    requires_python: str
    torch_pin: str | None

    @classmethod
    def parse(cls, metadata: str) -> Release:
        def field(name: str) -> str | None:
            match = re.search(rf"^{name}: *(.+?)\s*$", metadata, re.M)
            return match.group(1) if match else None

        clauses = [c.strip() for c in (field("Requires-Python") or "").split(",") if c.strip()]
        clauses.sort(key=lambda clause: not clause.startswith(">"))
        pin = re.search(r"^Requires-Dist: torch *==([^;\s]+)\s*$", metadata, re.M)
        return cls(field("Version") or "?", ", ".join(clauses), pin.group(1) if pin else None)

    def python_allows(self, version: tuple[int, int]) -> bool:
        """Whether Python X.Y meets every clause (`>=3.11`, `<3.15`; X.Y compared as X.Y.0)."""
        for clause in filter(None, self.requires_python.split(", ")):
            match = re.fullmatch(r"(>=|<=|==|!=|>|<) *(\d+(?:\.\d+)*)(\.\*)?", clause)
            if match is None:
                continue  # a clause this reader does not know: pip's business, not the check's
            op, bound, star = match.groups()
            want = tuple(int(x) for x in bound.split("."))
            have = (*version, 0)[: len(want)] if not star else version[: len(want)]
            if not _OPERATORS[op](have, want):
                return False
        return True


def find_release() -> Release | None:
    """The METADATA of the vLLM on this Python's path, else of the bundle's sources."""
    try:
        text = importlib.metadata.distribution("vllm").read_text("METADATA")
    except importlib.metadata.PackageNotFoundError:
        text = None
    if text is None:
        found = sorted(BUNDLE_SOURCES.glob("vllm-*.dist-info/METADATA"))
        text = found[0].read_text() if found else None
    return None if text is None else Release.parse(text)


def check_python(version: tuple[int, int], release: Release) -> None:
    if not release.python_allows(version):
        raise Refusal(
            f"Python {version[0]}.{version[1]} is outside vLLM {release.version}'s range "
            f"({release.requires_python}): set PYTHON to another interpreter"
        )


def check_needs(needs: dict[str, dict]) -> None:
    """The compiled packages the checks import must import here: the bundle's (carried.py
    laid them on the path) or the machine's own (the target has them, or they cannot be
    carried)."""
    missing = []
    for module, need in sorted(needs.items()):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(f"{need['requirement']} ({need['why']})")
    if missing:
        # no `pip install` advice: the machine the bundle is for is offline
        raise Refusal(
            f"this Python lacks compiled packages the checks import: {'; '.join(missing)}: "
            "add them to this Python (wheels for its platform and Python version), build the "
            "bundle for a target without them (`make gpu-bundle TARGET=ARCH-pyX.Y`), or run "
            "the check in the serving image"
        )


def nvidia_smi() -> dict[str, str]:
    """GPU name and driver version from nvidia-smi (empty when there is none)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
    proc = subprocess.run(query, capture_output=True, text=True, timeout=30)
    if proc.returncode or not proc.stdout.strip():
        return {}
    name, _, driver = proc.stdout.splitlines()[0].rpartition(",")
    return {"gpu": name.strip(), "driver": driver.strip()}


def version_of(dist: str, module: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:
        return None


def vllm_version() -> tuple[str | None, str | None]:
    """vLLM's version and where its package comes from (the sources on the path, or the
    installed one)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        return None, None
    try:
        from vllm.version import __version__
    except Exception:
        return None, spec.origin
    return str(__version__), spec.origin


def collect(device: str, needs: dict[str, dict]) -> dict:
    info: dict = {"python": sys.version.split()[0], "executable": sys.executable}
    release = find_release()
    if release is not None:
        check_python(sys.version_info[:2], release)
        info["vllm_release"] = release.version
        info["vllm_requires_python"] = release.requires_python
        info["vllm_torch_pin"] = release.torch_pin
    info.update(nvidia_smi())
    if device == "cuda" and "gpu" not in info:
        raise Refusal("no NVIDIA GPU here (nvidia-smi found none): run it on a CUDA machine")
    try:
        import torch
    except ImportError as exc:
        raise Refusal(f"{sys.executable} cannot import torch ({exc}): set PYTHON") from None
    info["torch"] = torch.__version__
    info["torch_cuda_build"] = torch.version.cuda
    info["triton"] = version_of("triton", "triton")
    info["vllm"], info["vllm_file"] = vllm_version()
    pin = None if release is None else release.torch_pin
    info["torch_is_vllm_pin"] = None if pin is None else torch.__version__.split("+")[0] == pin
    if device == "cuda":
        if torch.version.cuda is None:
            raise Refusal(
                f"torch {torch.__version__} is a build without CUDA: set PYTHON to a Python "
                "with CUDA torch, or run in the serving image"
            )
        if not torch.cuda.is_available():
            raise Refusal(
                f"torch {torch.__version__} (CUDA {torch.version.cuda}) cannot use the GPU "
                f"with driver {info.get('driver', '?')}: it needs a driver for CUDA "
                f"{torch.version.cuda} or later"
            )
        info["torch_device"] = torch.cuda.get_device_name()
    check_needs(needs)
    return info


def main() -> int:
    device, result_path = sys.argv[1], Path(sys.argv[2])
    needs = json.loads(Path(sys.argv[3]).read_text()) if len(sys.argv) > 3 else {}
    try:
        info = collect(device, needs)
    except Refusal as refusal:
        print(f"gpu-check: {refusal}", file=sys.stderr)
        return EXIT_USAGE
    result_path.write_text(json.dumps(info, indent=2))
    pins = ""
    if info["torch_is_vllm_pin"] is False:
        pins = f" (vLLM {info['vllm_release']} pins torch {info['vllm_torch_pin']})"
    print(
        f"gpu-check: {info.get('gpu', 'no GPU')}, driver {info.get('driver', '-')}; "
        f"Python {info['python']}; torch {info['torch']} (CUDA build {info['torch_cuda_build']})"
        f"{pins}; triton {info['triton']}; vLLM {info['vllm']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
