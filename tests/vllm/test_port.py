"""`sparkple patch port` against the real vLLM 0.33.0 and 0.34.0 wheels (harness/wheel_cache.py).

vllm-0.34 was ported from vllm-0.33 by hand; the port must find exactly what that took: every
pinned file changed, and four anchors that no longer occur once.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import wheel_cache
from sparkple import patch
from sparkple.errors import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE

REPO = Path(__file__).resolve().parents[2]
OLD, NEW = "vllm-0.33", "vllm-0.34"
# vllm-0.33's edits whose anchors do not occur exactly once in vLLM 0.34.0: template -> count
BROKEN_IN_034 = {
    "edits/select_backend.py.j2": 0,
    "edits/skip_table_shards.py.j2": 0,
    "edits/host_step.py.j2": 0,
    "edits/dummy_step.py.j2": 2,
}
BROKEN_LINE = re.compile(r"^BROKEN  (\S+) (\S+)(?: \(edit \d+\))?: anchor occurs (\d+) times$")


def sparkple_port(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sparkple.cli", "patch", "port", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def lines_with(output: str, prefix: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(prefix)]


@pytest.fixture(scope="module")
def wheel_034() -> Path:
    return wheel_cache.vllm_wheel("0.34.0")


def test_port_033_to_034_finds_the_four_broken_anchors(wheel_034: Path) -> None:
    result = sparkple_port("--from", OLD, "--vllm-sources", wheel_034)
    assert result.returncode == EXIT_CHECK_FAILED, result.stderr
    out = result.stdout
    old = patch.load_profile(OLD)
    changed = lines_with(out, "changed ")
    assert len(changed) == len(old.originals) == 5
    assert {line.split()[1] for line in changed} == set(old.originals)
    assert not lines_with(out, "same ") and not lines_with(out, "missing ")
    broken = {}
    for line in lines_with(out, "BROKEN "):
        match = BROKEN_LINE.match(line)
        assert match, line
        broken[match.group(2)] = int(match.group(3))
    assert broken == BROKEN_IN_034
    n_edits = sum(len(edits) for edits in old.edits.values())
    assert len(lines_with(out, "holds ")) == n_edits - len(BROKEN_IN_034)
    # the last lines name what needs a person, one line per broken anchor
    tail = out.splitlines()[-len(BROKEN_IN_034) :]
    assert {t for t in BROKEN_IN_034 if any(t in line for line in tail)} == set(BROKEN_IN_034)
    assert "needs a person" in out.splitlines()[-len(BROKEN_IN_034) - 1]

    # the function says the same, with the version from the wheel's name
    report = patch.port(OLD, wheel_034)
    assert report.vllm_version == "0.34.0" and not report.ok
    assert {e.template: e.count for e in report.broken} == BROKEN_IN_034
    assert {o.status for o in report.originals} == {"changed"}


def test_write_drafts_the_034_profile(wheel_034: Path, tmp_path: Path) -> None:
    draft = tmp_path / "vllm-0.34"
    result = sparkple_port("--from", OLD, "--vllm-sources", wheel_034, "--write", draft)
    assert result.returncode == EXIT_CHECK_FAILED, result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["vllm-0.34"]  # no staging left behind
    drafted = patch.load_profile(draft)
    by_hand = patch.load_profile(NEW)
    assert drafted.name == NEW and drafted.vllm_version == "0.34.0"
    assert drafted.image == "vllm/vllm-openai:v0.34.0" == by_hand.image
    assert drafted.originals == by_hand.originals
    text = (draft / "profile.yml").read_text()
    port_lines = [line for line in text.splitlines() if line.strip().startswith("# PORT:")]
    assert len(port_lines) == 4
    assert sorted(re.findall(r"occurs (\d+) times in vLLM 0\.34\.0", text)) == ["0", "0", "0", "2"]
    # each comment sits right above its edit, at the edit's indentation
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("# PORT:"):
            assert lines[i + 1].startswith(line[: line.index("#")] + "- mode:"), lines[i + 1]
    # the comments of the profile survive, and the templates came along
    source = (patch.load_profile(OLD).directory / "profile.yml").read_text()
    comments = [line for line in source.splitlines() if line.lstrip().startswith("#")]
    assert all(comment in lines for comment in comments)
    for template in (REPO / "templates" / "vllm" / OLD).rglob("*.j2"):
        rel = template.relative_to(REPO / "templates" / "vllm" / OLD)
        assert (draft / rel).read_bytes() == template.read_bytes()

    # --name and --vllm-version override what the wheel says
    other = tmp_path / "other"
    result = sparkple_port(
        "--from", OLD, "--vllm-sources", wheel_034, "--write", other,
        "--name", "vllm-next", "--vllm-version", "0.34.1",
    )  # fmt: skip
    assert result.returncode == EXIT_CHECK_FAILED, result.stderr
    renamed = patch.load_profile(other)
    assert (renamed.name, renamed.vllm_version) == ("vllm-next", "0.34.1")
    assert renamed.image == "vllm/vllm-openai:v0.34.1"


def test_port_034_to_its_own_wheel_holds(wheel_034: Path) -> None:
    result = sparkple_port("--from", NEW, "--vllm-sources", wheel_034)
    assert result.returncode == EXIT_OK, result.stdout + result.stderr
    profile = patch.load_profile(NEW)
    assert len(lines_with(result.stdout, "same ")) == len(profile.originals)
    n_edits = sum(len(edits) for edits in profile.edits.values())
    assert len(lines_with(result.stdout, "holds ")) == n_edits
    assert not lines_with(result.stdout, "BROKEN ") and not lines_with(result.stdout, "changed ")


def test_port_033_to_its_extracted_sources_holds() -> None:
    package = wheel_cache.vllm_originals("0.33.0")
    # the vllm package directory, and the directory that holds it
    for sources in (package, package.parent):
        result = sparkple_port("--from", OLD, "--vllm-sources", sources)
        assert result.returncode == EXIT_OK, result.stdout + result.stderr
        assert not lines_with(result.stdout, "BROKEN ")
    report = patch.port(OLD, package, vllm_version="0.33.0")
    assert report.ok and report.vllm_version == "0.33.0"
    assert {o.status for o in report.originals} == {"same"}


def test_bad_sources_and_a_non_empty_write_dir_are_refused(wheel_034: Path, tmp_path: Path) -> None:
    empty = tmp_path / "sources"
    (empty / "vllm").mkdir(parents=True)
    result = sparkple_port("--from", OLD, "--vllm-sources", empty)
    assert result.returncode in (EXIT_CHECK_FAILED, EXIT_USAGE)
    assert result.returncode == EXIT_USAGE
    assert "no vLLM sources at" in result.stderr and "originals" in result.stderr
    assert not result.stdout

    not_a_wheel = tmp_path / "vllm-0.34.0-py3-none-any.whl"
    not_a_wheel.write_bytes(b"not a zip")
    result = sparkple_port("--from", OLD, "--vllm-sources", not_a_wheel)
    assert result.returncode == EXIT_USAGE and "cannot read" in result.stderr

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine\n")
    result = sparkple_port("--from", OLD, "--vllm-sources", wheel_034, "--write", taken)
    assert result.returncode == EXIT_USAGE
    assert "is not empty" in result.stderr
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]
    assert (taken / "notes.txt").read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["sources", not_a_wheel.name, "taken"]
    )

    # an empty directory is fine: it becomes the draft
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    result = sparkple_port("--from", OLD, "--vllm-sources", wheel_034, "--write", fresh)
    assert result.returncode == EXIT_CHECK_FAILED, result.stderr
    assert patch.load_profile(fresh).vllm_version == "0.34.0"
