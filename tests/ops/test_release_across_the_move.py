"""A rollback to a release made before the host programs moved (sparkple/ops/ into supervise/,
pair/, metrics/, provision/): the release's server runs on the package version it was made with
(the release role's deploy mounts that version: tests/fleet/test_release_role.py), which has the
old layout, while the supervisor runs from the newest package, by the unit's new module path or
by the old one a unit rendered before the move still has. The old package is the tree of the last
commit before the move, as sparkple_package installed it (tests/package_before_the_move.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lab_inputs import free_port
from ops_helpers import ROOT, LabService, program, read_json, wait_for
from package_before_the_move import ARCHIVE, BEFORE_THE_MOVE, unpack

pytestmark = pytest.mark.slow  # the lab server starts three times


@pytest.fixture(scope="module")
def old_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package version a release made before the move runs with, unpacked as
    sparkple_package unpacks one."""
    version = tmp_path_factory.mktemp("versions") / BEFORE_THE_MOVE[:16]
    version.mkdir()
    return unpack(version)


def test_the_archive_is_the_package_before_the_move() -> None:
    """Where this checkout has the commit (a full clone), the archive is its tree."""
    git = shutil.which("git")
    known = (
        git is not None
        and subprocess.run(
            [git, "cat-file", "-e", f"{BEFORE_THE_MOVE}^{{commit}}"], cwd=ROOT, capture_output=True
        ).returncode
        == 0
    )
    listed = subprocess.run(["tar", "-tzf", ARCHIVE], capture_output=True, text=True, check=True)
    assert "sparkple/ops/pair_head.py" in listed.stdout.split()
    if known:  # a shallow clone lacks it: the listing above is what can be checked there
        assert git is not None
        tree = subprocess.run(
            [git, "archive", "--format=tar", BEFORE_THE_MOVE, "sparkple", "templates"],
            cwd=ROOT, capture_output=True, check=True, timeout=60,
        )  # fmt: skip
        unpacked = subprocess.run(["gzip", "-dc", ARCHIVE], capture_output=True, check=True)
        assert unpacked.stdout == tree.stdout


def served_from(service: LabService, package: Path, site: Path) -> None:
    """The server runs on `package` (as a release's container runs on its package version)."""
    spec = json.loads((service.dir / "service.json").read_text())
    spec["env"]["PYTHONPATH"] = f"{package}:{site}"
    (service.dir / "service.json").write_text(json.dumps(spec))


def completion(url: str) -> dict[str, Any]:
    body = json.dumps({"prompt": "hello spark", "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        reply: dict[str, Any] = json.loads(answer.read())
        return reply


@pytest.mark.parametrize(
    "unit", ["new", "old"], ids=["unit rendered after the move", "unit rendered before it"]
)
def test_a_release_made_before_the_move_starts_and_is_supervised(
    tmp_path: Path,
    lab_data: dict[str, Any],
    old_package: Path,
    procs: Callable[[list[str]], subprocess.Popen[bytes]],
    unit: str,
) -> None:
    service = LabService(tmp_path / "service", free_port(), lab_data)
    served_from(service, old_package, lab_data["site"])
    state = tmp_path / "state"
    argv = program(
        "supervisor", "run",
        "--state-dir", state,
        "--check-cmd", service.cmd("is-active"),
        "--start-cmd", service.cmd("start"),
        "--stop-cmd", service.cmd("stop"),
        "--url", service.url,
        "--poll-s", 0.2,
        "--backoff-base-s", 0.5,
        "--stable-s", 60,
    )  # fmt: skip
    if unit == "old":
        argv[argv.index("-m") + 1] = "sparkple.ops.supervisor"  # what the old unit runs

    def supervised() -> dict[str, Any]:
        return read_json(state / "supervisor.json")

    try:
        supervisor = procs(argv)  # from the newest package: this checkout
        wait_for(lambda: supervised().get("state") == "running", 120, "the supervisor's launch")
        # the server it launched runs the old package, not this checkout's
        environ = Path(f"/proc/{service.pid('front')}/environ").read_bytes().split(b"\0")
        assert f"PYTHONPATH={old_package}:{lab_data['site']}".encode() in environ
        assert completion(service.url)["choices"][0]["text"]
        first = service.pid("front")

        # a crash of the old release's server: the supervisor relaunches it, on the old package
        service.kill_all()
        wait_for(
            lambda: service.active() and service.pid("front") != first and (
                supervised().get("state") == "running"),
            120, "the relaunch",
        )  # fmt: skip
        events = [h["event"] for h in supervised()["history"]]
        assert "down" in events and events.count("relaunch") == 2, events
        assert completion(service.url)["choices"][0]["text"]
        assert supervisor.poll() is None
        shown = subprocess.run(
            program("supervisor", "status", "--state-dir", state),
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert shown.returncode == 0 and "supervisor: running" in shown.stdout, shown.stdout
    finally:
        service.kill_all()
