"""The patch engine against the real vLLM files from the PyPI wheels: every profile (vllm-0.34,
the default, and vllm-0.33) against its own release's files."""

from __future__ import annotations

import difflib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness import wheel_cache
from sparkple import patch
from sparkple.cli import main
from sparkple.errors import PatchError

REPO = Path(__file__).resolve().parents[2]
# every profile the checkout ships: the default first
PROFILES = [patch.DEFAULT_PROFILE] + sorted(
    {p.parent.name for p in (REPO / "templates" / "vllm").glob("*/profile.yml")}
    - {patch.DEFAULT_PROFILE}
)
TARGET = "models/qwen4_exp/nvidia/ngram_embedding.py"
ADDED = "models/qwen4_exp/common/ple_mmap_embedding.py"
STATE = "models/qwen4_exp/nvidia/model_state.py"
LOADER_FILTER = "model_executor/model_loader/ep_weight_filter.py"
COMMON = "models/qwen4_exp/common/ngram_embedding.py"
EDITED = (TARGET, COMMON, STATE, LOADER_FILTER)


@pytest.fixture(scope="module", params=PROFILES)
def profile_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def release_originals(profile_name: str, vllm_originals: Path) -> Path:
    """The `vllm` package directory of the profile's own release (the default's may be given:
    SPARKPLE_VLLM_SOURCES)."""
    version = patch.load_profile(profile_name).vllm_version
    if version == wheel_cache.VLLM_VERSION:
        return vllm_originals
    return wheel_cache.vllm_originals(version)


@pytest.fixture
def originals(profile_name: str, release_originals: Path, tmp_path: Path) -> Path:
    """A private, writable copy of the profile's originals."""
    root = tmp_path / "originals"
    for rel in patch.load_profile(profile_name).originals:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(release_originals / rel, root / rel)
    return root


def repinned_profile(tmp_path: Path, originals: Path, profile_name: str) -> Path:
    """A copy of the profile whose pins match the (mutated) originals, to reach later checks."""
    copy = tmp_path / "profile-copy"
    shutil.copytree(patch.load_profile(profile_name).directory, copy)
    data = yaml.safe_load((copy / "profile.yml").read_text())
    for rel in data["originals"]:
        data["originals"][rel] = patch.sha256_file(originals / rel)
    (copy / "profile.yml").write_text(yaml.safe_dump(data, sort_keys=False))
    return copy


def test_pins_equal_the_wheel_files(profile_name: str, release_originals: Path) -> None:
    profile = patch.load_profile(profile_name)
    assert profile.vllm_version == f"{profile_name.removeprefix('vllm-')}.0"
    assert profile.image == f"vllm/vllm-openai:v{profile.vllm_version}"
    assert set(profile.originals) >= {TARGET, "models/qwen4_exp/common/ngram_embedding.py"}
    for rel, pinned in profile.originals.items():
        assert patch.sha256_file(release_originals / rel) == pinned, rel


def test_the_default_profile_is_the_newest() -> None:
    def release(name: str) -> tuple[int, ...]:
        return tuple(int(part) for part in patch.load_profile(name).vllm_version.split("."))

    assert patch.DEFAULT_PROFILE == max(PROFILES, key=release) == "vllm-0.34"
    assert wheel_cache.VLLM_VERSION == "0.34.0"


def test_render_applies_every_edit_and_check_passes(
    profile_name: str, originals: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    manifest = patch.render(profile_name, originals, out)
    profile = patch.load_profile(profile_name)
    assert set(profile.edits) == set(EDITED)
    for rel, edits in profile.edits.items():
        patched = (out / rel).read_text()
        original = (originals / rel).read_text()
        for edit in edits:
            assert patched.count(edit.anchor) == 1  # the anchor itself is kept
        assert patched.count(patch.PATCH_MARKER) == len(edits), rel
        # the edits only add lines
        matcher = difflib.SequenceMatcher(a=original.splitlines(), b=patched.splitlines())
        assert {op for op, *_ in matcher.get_opcodes()} == {"equal", "insert"}, rel
    assert "Qwen4ExpPLEPackedTableEmbedding" in (out / TARGET).read_text()
    assert "host_step(" in (out / STATE).read_text()
    assert "dummy_step(" in (out / STATE).read_text()
    assert "is_packed_ple_row_shard(weight_name)" in (out / LOADER_FILTER).read_text()
    on_disk = json.loads((out / patch.MANIFEST_NAME).read_text())
    assert on_disk == json.loads(json.dumps(manifest))
    entries = {entry["path"]: entry for entry in on_disk["files"]}
    assert set(entries) == {*EDITED, ADDED}
    for rel in EDITED:
        assert entries[rel]["original_sha256"] == patch.sha256_file(originals / rel)
    assert entries[ADDED]["original_sha256"] is None
    for rel, entry in entries.items():
        assert entry["patched_sha256"] == patch.sha256_file(out / rel)
        assert len(entry["template_sha256"]) == 64
    assert on_disk["profile"] == profile_name
    assert on_disk["vllm_version"] == patch.load_profile(profile_name).vllm_version
    assert on_disk["variables"] == {"lookahead_mib": 256, "staging_slots": 3}
    assert set(on_disk["env"]) == {"SPARKPLE_PLE_TABLE_DIR", "SPARKPLE_PLE_STEP_TIMEOUT"}
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model_executor", "models"]
    assert patch.check(out) == []
    # no temporary directories left beside OUT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["originals", "out"]


def test_variables_are_rendered_and_validated(
    profile_name: str, originals: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    patch.render(
        profile_name,
        originals,
        out,
        {"lookahead_mib": "64", "staging_slots": "2"},
    )
    added = (out / ADDED).read_text()
    assert "    lookahead_bytes = 64 * 2**20\n" in added
    assert "    staging_slots = 2\n" in added
    # the step timeout is the serving unit's SPARKPLE_PLE_STEP_TIMEOUT alone, and the prefetch
    # runs before every gather: no render knob for either
    bad = {
        "lookahead_mib": "lots",
        "staging_slots": "0",
        "step_timeout_s": "42.5",
        "prefetch_policy": "never",
        "prefill_min_tokens": "64",
        "no_such_variable": "1",
    }
    for name, value in bad.items():
        with pytest.raises(PatchError, match=name):
            patch.render(profile_name, originals, tmp_path / "never", {name: value})
    assert not (tmp_path / "never").exists()


def test_rendered_python_passes_ruff(profile_name: str, originals: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    patch.render(profile_name, originals, out)
    ruff = [sys.executable, "-m", "ruff"]
    config = ["--config", str(REPO / "pyproject.toml")]
    added = str(out / ADDED)
    subprocess.run([*ruff, "check", *config, added], check=True)
    subprocess.run([*ruff, "format", "--check", *config, added], check=True)

    # vLLM's own file follows vLLM's lint config: the edit must add no finding of its own.
    def findings(path: Path) -> list[str]:
        result = subprocess.run(
            [*ruff, "check", *config, "--output-format", "json", "--exit-zero", str(path)],
            capture_output=True,
            text=True,
            check=True,
        )
        return sorted(item["code"] for item in json.loads(result.stdout))

    for rel in EDITED:
        assert findings(out / rel) == findings(originals / rel), rel


def test_mutated_original_is_refused(profile_name: str, originals: Path, tmp_path: Path) -> None:
    target = originals / TARGET
    pinned = patch.load_profile(profile_name).originals[TARGET]
    target.write_text(target.read_text().replace("Qwen4Exp", "Qwen4Exq", 1))
    actual = patch.sha256_file(target)
    out = tmp_path / "out"
    with pytest.raises(PatchError) as info:
        patch.render(profile_name, originals, out)
    message = str(info.value)
    assert TARGET in message and pinned in message and actual in message
    assert not out.exists()


def test_duplicated_anchor_is_refused(profile_name: str, originals: Path, tmp_path: Path) -> None:
    target = originals / TARGET
    anchor = patch.load_profile(profile_name).edits[TARGET][1].anchor
    target.write_text(target.read_text() + "\n\ndef twice(self):\n" + anchor)
    profile = repinned_profile(
        tmp_path, originals, profile_name
    )  # the pins pass; the anchor check must not
    out = tmp_path / "out"
    with pytest.raises(PatchError, match="occurs 2 times"):
        patch.render(profile, originals, out)
    assert not out.exists()


def test_missing_anchor_is_refused(profile_name: str, originals: Path, tmp_path: Path) -> None:
    target = originals / TARGET
    anchor = patch.load_profile(profile_name).edits[TARGET][0].anchor
    target.write_text(target.read_text().replace(anchor, ""))
    profile = repinned_profile(tmp_path, originals, profile_name)
    with pytest.raises(PatchError, match="occurs 0 times"):
        patch.render(profile, originals, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_already_patched_file_is_refused(
    profile_name: str, originals: Path, tmp_path: Path
) -> None:
    first = tmp_path / "first"
    patch.render(profile_name, originals, first)
    shutil.copyfile(first / TARGET, originals / TARGET)
    out = tmp_path / "out"
    with pytest.raises(PatchError, match="already carries the sparkple patch"):
        patch.render(profile_name, originals, out)
    # even with pins that match the patched file, the marker refuses it
    profile = repinned_profile(tmp_path, originals, profile_name)
    with pytest.raises(PatchError, match="already patched"):
        patch.render(profile, originals, out)
    assert not out.exists()


def test_unparsable_result_is_refused(profile_name: str, originals: Path, tmp_path: Path) -> None:
    profile = repinned_profile(tmp_path, originals, profile_name)
    (profile / "edits" / "select_backend.py.j2").write_text("        # {{ marker }}\n    oops(\n")
    with pytest.raises(PatchError, match="not valid Python"):
        patch.render(profile, originals, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refusal_keeps_an_earlier_render(
    profile_name: str, originals: Path, release_originals: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    patch.render(profile_name, originals, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    (originals / TARGET).write_text("# not vllm\n")
    with pytest.raises(PatchError):
        patch.render(profile_name, originals, out)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # a foreign, non-empty directory is never replaced
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(PatchError, match="not empty"):
        patch.render(profile_name, release_originals, foreign)
    assert [p.name for p in foreign.iterdir()] == ["keep.txt"]


def test_check_catches_modified_missing_and_extra_files(
    profile_name: str, originals: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    patch.render(profile_name, originals, out)
    with (out / ADDED).open("a") as handle:
        handle.write("# local change\n")
    problems = patch.check(out)
    assert len(problems) == 1 and ADDED in problems[0]
    (out / TARGET).unlink()
    (out / "stray.py").write_text("")
    problems = patch.check(out)
    assert any(TARGET in p and "missing" in p for p in problems)
    assert any("stray.py" in p for p in problems)
    (out / patch.MANIFEST_NAME).unlink()
    assert patch.check(out)


def test_cli_exit_codes(
    profile_name: str, originals: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    args = ["patch", "render", "--profile", profile_name, "--originals", str(originals)]
    assert main([*args, "--out", str(out), "--var", "staging_slots=3"]) == 0
    assert "    staging_slots = 3\n" in (out / ADDED).read_text()
    assert main(["patch", "check", str(out)]) == 0
    (out / TARGET).write_text((out / TARGET).read_text() + "\n")
    assert main(["patch", "check", str(out)]) == 1
    assert TARGET in capsys.readouterr().out
    (originals / TARGET).write_text("x = 1\n")
    assert main([*args, "--out", str(tmp_path / "refused")]) == 1
    assert "does not match the pinned" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
    assert main([*args, "--out", str(tmp_path / "o2"), "--var", "lookahead_mib"]) == 1
    assert main([*args, "--out", str(tmp_path / "o3"), "--profile", "vllm-9.99"]) == 1
    with pytest.raises(SystemExit) as usage:
        main(["patch", "render", "--profile", profile_name])
    assert usage.value.code == 2


def test_check_compile_compiles_every_file(
    profile_name: str, originals: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    patch.render(profile_name, originals, out)
    assert main(["patch", "check", "--compile", str(out)]) == 0
    assert "every file matches manifest.json and compiles" in capsys.readouterr().out
    # a file that matches its manifest but does not compile (as if rendered for another Python)
    (out / ADDED).write_text((out / ADDED).read_text() + "\ndef broken(:\n")
    manifest = json.loads((out / patch.MANIFEST_NAME).read_text())
    for entry in manifest["files"]:
        if entry["path"] == ADDED:
            entry["patched_sha256"] = patch.sha256_file(out / ADDED)
    (out / patch.MANIFEST_NAME).write_text(json.dumps(manifest))
    assert main(["patch", "check", str(out)]) == 0
    assert main(["patch", "check", "--compile", str(out)]) == 1
    assert f"{ADDED}: does not compile with Python" in capsys.readouterr().out


def test_another_releases_files_name_the_profile_to_render(tmp_path: Path) -> None:
    """An image of the other release (its files match another profile's pins): the refusal
    names the profile those files belong to and the roles' knob, and writes nothing."""
    old, new = "vllm-0.33", "vllm-0.34"
    for profile, other in ((old, new), (new, old)):
        sources = wheel_cache.vllm_originals(patch.load_profile(other).vllm_version)
        with pytest.raises(PatchError) as info:
            patch.render(profile, sources, tmp_path / profile)
        message = str(info.value)
        assert f"it is the file of profile {other}" in message, message
        assert "vllm_patches_profile" in message
        assert not (tmp_path / profile).exists()
    # a file no profile pins: the port command is the way on
    copy = tmp_path / "foreign"
    rel = next(iter(patch.load_profile(new).originals))
    (copy / rel).parent.mkdir(parents=True)
    (copy / rel).write_text("# another vLLM\n")
    with pytest.raises(PatchError, match="no profile here pins it: port one with"):
        patch.render(new, copy, tmp_path / "out")
