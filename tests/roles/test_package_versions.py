"""sparkple_package installs each package version into a directory of its own and switches the
sparkple_package_dir link to it in one rename: what runs from the old version keeps its files,
an install made before versions is kept as one, an unchanged package changes nothing, and the
versions pruned are the old ones no release names. The real role, on this machine (connection
local), installing a small checkout of its own."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from ansible_local import run_playbook

pytestmark = pytest.mark.slow  # a few ansible-playbook runs

PLAY = """
- hosts: localhost
  gather_facts: false
  roles:
    - role: sparkple_package
"""


def checkout(root: Path, version: str) -> Path:
    """A checkout whose package says which version it is."""
    (root / "sparkple").mkdir(parents=True, exist_ok=True)
    (root / "templates" / "vllm").mkdir(parents=True, exist_ok=True)
    (root / "sparkple" / "__init__.py").write_text(f'VERSION = "{version}"\n')
    (root / "templates" / "vllm" / "profile.txt").write_text("profile\n")
    return root


def install(tmp_path: Path, src: Path, **extra: object) -> int:
    variables = {"sparkple_package_src": str(src),
                 "sparkple_package_dir": str(tmp_path / "opt" / "sparkple"),
                 "sparkple_release_dir": str(tmp_path / "releases"), **extra}  # fmt: skip
    done = run_playbook(tmp_path, PLAY, variables)
    assert done.returncode == 0, done.stdout[-3000:]
    recap = re.search(r"localhost\s*:.*changed=(\d+)", done.stdout)
    assert recap is not None
    return int(recap.group(1))


def test_each_version_has_its_directory_and_the_link_moves_in_one_rename(tmp_path: Path) -> None:
    link = tmp_path / "opt" / "sparkple"
    versions = tmp_path / "opt" / "sparkple.versions"
    src = checkout(tmp_path / "src", "1")
    assert install(tmp_path, src) > 0
    first = Path(os.readlink(link))
    assert (
        first.parent == versions
        and (link / "sparkple" / "__init__.py").read_text() == 'VERSION = "1"\n'
    )
    assert install(tmp_path, src) == 0, "an unchanged package changes nothing"
    # a server started on version 1 holds its directory (as a container holds a bind mount)
    held = os.open(first / "sparkple" / "__init__.py", os.O_RDONLY)
    checkout(src, "2")
    assert install(tmp_path, src) > 0
    second = Path(os.readlink(link))
    assert second != first and (link / "sparkple" / "__init__.py").read_text() == 'VERSION = "2"\n'
    assert (first / "sparkple" / "__init__.py").read_text() == 'VERSION = "1"\n', "kept"
    assert os.pread(held, 64, 0) == b'VERSION = "1"\n'
    os.close(held)
    assert not [p for p in versions.iterdir() if p.name.endswith(".partial")]


def test_an_install_made_before_versions_is_kept_as_one(tmp_path: Path) -> None:
    old = tmp_path / "opt" / "sparkple"
    (old / "sparkple").mkdir(parents=True)
    (old / "sparkple" / "__init__.py").write_text('VERSION = "plain"\n')
    (old / ".fingerprint").write_text("ab" * 32 + "\n")
    install(tmp_path, checkout(tmp_path / "src", "1"))
    assert old.is_symlink()
    kept = tmp_path / "opt" / "sparkple.versions" / ("ab" * 8)
    assert (kept / "sparkple" / "__init__.py").read_text() == 'VERSION = "plain"\n'


def test_old_versions_go_unless_a_release_names_them(tmp_path: Path) -> None:
    src = checkout(tmp_path / "src", "0")
    install(tmp_path, src, sparkple_package_keep_versions=2)
    named = os.readlink(tmp_path / "opt" / "sparkple")
    release = tmp_path / "releases" / "0123456789abcdef"
    release.mkdir(parents=True)
    (release / "release.json").write_text(json.dumps({"inputs": {"package": Path(named).name * 4}}))
    for version in ("1", "2", "3", "4"):
        checkout(src, version)
        install(tmp_path, src, sparkple_package_keep_versions=2)
    versions = tmp_path / "opt" / "sparkple.versions"
    left = {(p / "sparkple" / "__init__.py").read_text() for p in versions.iterdir()}
    # the two newest, and version 0 that a release names
    assert left == {'VERSION = "4"\n', 'VERSION = "3"\n', 'VERSION = "0"\n'}
