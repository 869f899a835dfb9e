"""The bundle's packages laid out for this machine: the machine's own copy where it is as new
and meets every requirement on it, else the bundle's.

Usage: python carried.py BUNDLE_DIR DEST REPORT_JSON

Reads BUNDLE_DIR/carried.json (written by gpu/bundle.py): the target the bundle was built for,
and each carried package (a pure-Python copy under site/, or the target's wheel under wheels/)
with its version and what the imported packages require of it. Refuses (exit 2, one line) a
Python or architecture other than the target's, whose wheels would not load. For each
package, this Python's own copy is used when its version is at least the bundle's and meets
every requirement on it, and the packages it pins (pydantic pins pydantic-core) are used
from the same side; otherwise the bundle's copy is laid into DEST (wheels unpacked, pure
copies linked), which gpu-check.sh puts on PYTHONPATH. Writes which copy was used, and why,
to REPORT_JSON and prints one line. Standard library, and `packaging` from the bundle.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import sys
import zipfile
from pathlib import Path

EXIT_USAGE = 2


def machine_versions(names: list[str]) -> dict[str, str]:
    """This Python's own version of each of names (those it has), from its own paths only."""
    found = {}
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def choose(packages: dict[str, dict], machine: dict[str, str], requires_of) -> dict[str, dict]:
    """{name: {"used": "machine"|"bundle", "version", "why"}} for every carried package.

    machine: this Python's versions; requires_of(name): {dependency: specifier} that this
    Python's own copy of name requires (a machine copy kept must find what it pins).
    """
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    def meets(version: str, requirements: list[list[str]]) -> list[str]:
        return [
            f"{requirer} needs {spec}"
            for requirer, spec in requirements
            if not SpecifierSet(spec).contains(version, prereleases=True)
        ]

    chosen: dict[str, dict] = {}
    for name, entry in packages.items():
        carried, own = entry["version"], machine.get(name)
        if own is None:
            chosen[name] = {"used": "bundle", "version": carried, "why": "not on this machine"}
        elif Version(own) < Version(carried):
            why = f"this machine's {own} is older than the bundle's {carried}"
            chosen[name] = {"used": "bundle", "version": carried, "why": why}
        elif unmet := meets(own, entry["requires"]):
            why = f"this machine's {own} does not meet {'; '.join(unmet)}"
            chosen[name] = {"used": "bundle", "version": carried, "why": why}
        else:
            why = f"this machine's {own}, at least the bundle's {carried}, meets every requirement"
            chosen[name] = {"used": "machine", "version": own, "why": why}
    # a machine copy kept must find its own pins among the versions used (pydantic and its
    # pydantic-core come from one side); one that does not is replaced, until none changes
    changed = True
    while changed:
        changed = False
        versions = {canonicalize_name(n): c["version"] for n, c in chosen.items()}
        for name, choice in chosen.items():
            if choice["used"] != "machine":
                continue
            for dependency, spec in requires_of(name).items():
                used = versions.get(canonicalize_name(dependency))
                if used is not None and not SpecifierSet(spec).contains(used, prereleases=True):
                    carried = packages[name]["version"]
                    why = f"this machine's copy needs {dependency}{spec}, and {used} is used"
                    chosen[name] = {"used": "bundle", "version": carried, "why": why}
                    changed = True
                    break
    return chosen


def machine_requires(name: str) -> dict[str, str]:
    """{dependency: specifier} this Python's own copy of name requires, unconditionally."""
    from packaging.requirements import Requirement

    found = {}
    for text in importlib.metadata.requires(name) or []:
        requirement = Requirement(text)
        if requirement.marker is None and str(requirement.specifier):
            found[requirement.name] = str(requirement.specifier)
    return found


def lay_out(bundle: Path, packages: dict[str, dict], chosen: dict[str, dict], dest: Path) -> None:
    """The bundle's copies of the packages chosen from it, in DEST."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, choice in chosen.items():
        if choice["used"] != "bundle":
            continue
        entry = packages[name]
        if "wheel" in entry:
            with zipfile.ZipFile(bundle / entry["wheel"]) as wheel:
                wheel.extractall(dest)
            continue
        for rel in entry["site"]:
            link = dest / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                os.symlink(bundle / "site" / rel, link)


def check_target(target: dict) -> str | None:
    """Why this Python cannot load the target's wheels, or None."""
    python = "{}.{}".format(*sys.version_info[:2])
    arch = platform.machine()
    if (python, arch) != (target["python"], target["arch"]):
        return (
            f"this bundle carries wheels for {target['arch']} Python {target['python']} "
            f"({target['name']}); this is {arch} Python {python}: set PYTHON to a Python "
            f"{target['python']}, or build one for this machine with "
            f"`make gpu-bundle TARGET={arch}-py{python}`"
        )
    return None


def main() -> int:
    bundle, dest, report_path = (Path(arg).resolve() for arg in sys.argv[1:4])
    manifest = json.loads((bundle / "carried.json").read_text())
    refusal = check_target(manifest["target"])
    if refusal is not None:
        print(f"gpu-check: {refusal}", file=sys.stderr)
        return EXIT_USAGE
    packages = manifest["packages"]
    machine = machine_versions(list(packages))  # before the bundle is on the path
    # packaging from the bundle's copy where this Python has none, for this process only (it
    # comes after the machine's own paths, which machine_requires reads)
    sys.path.append(str(bundle / "site"))
    chosen = choose(packages, machine, machine_requires)
    lay_out(bundle, packages, chosen, dest)
    report_path.write_text(json.dumps(chosen, indent=2, sort_keys=True) + "\n")
    own = sorted(f"{n} {c['version']}" for n, c in chosen.items() if c["used"] == "machine")
    ours = sum(c["used"] == "bundle" for c in chosen.values())
    print(
        f"gpu-check: of {len(chosen)} carried packages, {ours} from the bundle, "
        f"{len(own)} this machine's own ({', '.join(own) or 'none'}); each, and why, in "
        f"{report_path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
