"""Port a profile to another vLLM release: which pins and anchors still hold, and a draft.

`port` compares a profile with the sources of another vLLM release (the `vllm` package
directory, a directory that holds `vllm/`, or a wheel, read member by member) without
rendering anything: each pinned original is the same, changed or missing, and each edit's
anchor occurs 0, 1 or many times in the new file. Only an anchor that occurs exactly once can
be applied, so the others are what a person has to widen or move by hand.

`write_draft` copies the profile under a new name and rewrites its `profile.yml` as text, so
its comments survive: the new pins, name, version and image, and a `# PORT:` comment above
each edit (and pin) that needs a person. The draft is loaded back before it is published, and
it appears all at once (written to a temporary sibling and renamed), like `render`'s output.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ..errors import PatchError
from .profile import PROFILE_NAME, Profile, load_profile, sha256_bytes

if TYPE_CHECKING:  # yaml is imported only when a draft is written
    import yaml

PACKAGE = "vllm"
VERSION_FILE = "_version.py"
PORT_MARK = "# PORT:"
# A wheel's file name carries its version: vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl
WHEEL_NAME = re.compile(r"^vllm-(?P<version>[^-]+)-.+\.whl$")
MAJOR_MINOR = re.compile(r"^v?(?P<major>\d+)\.(?P<minor>\d+)(?:[.+\-a-z]|$)")

OriginalStatus = Literal["same", "changed", "missing"]


class PortInputError(PatchError):
    """The port was asked something it cannot do (sources, output, version): a usage error."""


@dataclass(frozen=True)
class OriginalReport:
    rel: str
    status: OriginalStatus
    pinned_sha256: str
    new_sha256: str | None  # None when the new release lacks the file


@dataclass(frozen=True)
class EditReport:
    rel: str
    index: int  # position in the profile's list of edits for `rel`
    template: str
    mode: str
    count: int  # occurrences of the anchor in the new file (0 when the file is missing)

    @property
    def holds(self) -> bool:
        return self.count == 1


@dataclass(frozen=True)
class PortReport:
    profile: Profile
    sources: Path
    vllm_version: str | None  # of the new sources; None when nothing says
    originals: list[OriginalReport]
    edits: list[EditReport]

    @property
    def broken(self) -> list[EditReport]:
        return [edit for edit in self.edits if not edit.holds]

    @property
    def missing(self) -> list[OriginalReport]:
        return [orig for orig in self.originals if orig.status == "missing"]

    @property
    def ok(self) -> bool:
        """Every anchor occurs once and every original is there: the profile renders as is
        once its pins are updated."""
        return not self.broken and not self.missing


@dataclass(frozen=True)
class _Sources:
    """The new release's files the port reads, relative to the vllm package."""

    files: dict[str, bytes]
    version: str | None


def _version_from_text(text: str) -> str | None:
    """`__version__` or `version` assigned a string literal (vLLM's generated _version.py)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            if names & {"__version__", "version"} and isinstance(node.value.value, str):
                return node.value.value
    return None


def _read_wheel(wheel: Path, rels: Iterable[str]) -> _Sources:
    """Only the members asked for: a vLLM wheel is a few hundred MB of mostly kernels."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = set(archive.namelist())
            if not any(name.startswith(f"{PACKAGE}/") for name in members):
                raise PortInputError(f"{wheel} holds no {PACKAGE}/ package: not a vLLM wheel")
            files = {
                rel: archive.read(f"{PACKAGE}/{rel}")
                for rel in rels
                if f"{PACKAGE}/{rel}" in members
            }
            version_member = f"{PACKAGE}/{VERSION_FILE}"
            version_text = (
                archive.read(version_member).decode("utf-8", "replace")
                if version_member in members
                else None
            )
    except (zipfile.BadZipFile, OSError) as exc:
        raise PortInputError(f"cannot read {wheel} as a wheel: {exc}") from None
    match = WHEEL_NAME.match(wheel.name)
    version = match.group("version") if match else None
    if version is None and version_text is not None:
        version = _version_from_text(version_text)
    return _Sources(files=files, version=version)


def package_dir(sources: Path) -> Path:
    """The `vllm` package: `sources` itself, or its `vllm/` child when it has one."""
    child = sources / PACKAGE
    return child if child.is_dir() else sources


def _read_dir(directory: Path, rels: Iterable[str]) -> _Sources:
    package = package_dir(directory)
    files = {rel: (package / rel).read_bytes() for rel in rels if (package / rel).is_file()}
    version_file = package / VERSION_FILE
    version = (
        _version_from_text(version_file.read_text(errors="replace"))
        if version_file.is_file()
        else None
    )
    return _Sources(files=files, version=version)


def _read_sources(sources: Path, rels: list[str]) -> _Sources:
    if sources.is_dir():
        found = _read_dir(sources, rels)
    elif sources.is_file() and sources.suffix == ".whl":
        found = _read_wheel(sources, rels)
    else:
        raise PortInputError(
            f"{sources} is neither a directory nor a .whl file; pass the vllm package "
            "directory, a directory that holds vllm/, or a vLLM wheel"
        )
    if rels and not found.files:
        raise PortInputError(
            f"no vLLM sources at {sources}: none of the profile's {len(rels)} originals "
            f"(such as {rels[0]}) is there; pass the vllm package directory, a directory "
            "that holds vllm/, or a vLLM wheel"
        )
    return found


def port(
    profile: str | os.PathLike[str],
    sources: str | os.PathLike[str],
    vllm_version: str | None = None,
) -> PortReport:
    """Check `profile`'s pins and anchors against the vLLM sources at `sources`."""
    try:
        loaded = load_profile(profile)
    except PatchError as exc:
        raise PortInputError(str(exc)) from None
    path = Path(sources)
    found = _read_sources(path, list(loaded.originals))
    originals = []
    for rel, pinned in loaded.originals.items():
        data = found.files.get(rel)
        if data is None:
            originals.append(OriginalReport(rel, "missing", pinned, None))
            continue
        digest = sha256_bytes(data)
        status: OriginalStatus = "same" if digest == pinned else "changed"
        originals.append(OriginalReport(rel, status, pinned, digest))
    edits = []
    for rel, rel_edits in loaded.edits.items():
        data = found.files.get(rel)
        text = data.decode("utf-8", "replace") if data is not None else ""
        for index, edit in enumerate(rel_edits):
            count = text.count(edit.anchor) if data is not None else 0
            edits.append(EditReport(rel, index, edit.template, edit.mode, count))
    return PortReport(
        profile=loaded,
        sources=path,
        vllm_version=vllm_version or found.version,
        originals=originals,
        edits=edits,
    )


def default_name(version: str) -> str:
    """`vllm-<major>.<minor>`, the profiles' naming."""
    match = MAJOR_MINOR.match(version)
    if match is None:
        raise PortInputError(
            f"vLLM version {version!r} has no <major>.<minor>: pass --name for the new profile"
        )
    return f"vllm-{match.group('major')}.{match.group('minor')}"


def _yaml_scalar(value: str) -> str:
    """`value` as a YAML scalar that loads back as the same string (plain when it can be)."""
    import yaml

    try:
        plain = yaml.safe_load(value) == value and "#" not in value and "\n" not in value
    except yaml.YAMLError:
        plain = False
    return value if plain else json.dumps(value)


def _mapping_items(node: yaml.Node, where: str) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    import yaml

    if not isinstance(node, yaml.MappingNode):
        raise PatchError(f"{where} is not a block mapping; update it by hand")
    return {
        key.value: (key, value) for key, value in node.value if isinstance(key, yaml.ScalarNode)
    }


def _line_start(text: str, line: int) -> int:
    """Index of the first character of 0-based `line`."""
    index = 0
    for _ in range(line):
        index = text.index("\n", index) + 1
    return index


def _port_comment(text: str, line: int, message: str) -> tuple[int, int, str]:
    """An insertion of `# PORT: message` above `line`, at that line's indentation."""
    start = _line_start(text, line)
    indent = re.match(r"[ \t]*", text[start:])
    prefix = indent.group(0) if indent else ""
    return start, start, f"{prefix}{PORT_MARK} {message}\n"


def draft_text(text: str, report: PortReport, name: str, version: str) -> str:
    """`profile.yml`'s text with the new pins, name, version and image, and a `# PORT:`
    comment above every edit whose anchor does not occur once and every missing original;
    everything else, comments included, as it was."""
    import yaml

    where = f"{report.profile.directory / PROFILE_NAME}"
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise PatchError(f"{where} is not valid YAML: {exc}") from None
    if root is None:
        raise PatchError(f"{where} is empty")
    top = _mapping_items(root, where)
    changes: list[tuple[int, int, str]] = []  # (start, end, replacement) in `text`

    def replace(node: yaml.Node, value: str) -> None:
        changes.append((node.start_mark.index, node.end_mark.index, _yaml_scalar(value)))

    for key, value in (
        ("name", name),
        ("vllm_version", version),
        ("image", f"vllm/vllm-openai:v{version}"),
    ):
        replace(top[key][1], value)
    pins = _mapping_items(top["originals"][1], f"{where}: originals")
    for orig in report.originals:
        key_node, value_node = pins[orig.rel]
        if orig.new_sha256 is not None:
            replace(value_node, orig.new_sha256)
        else:
            changes.append(
                _port_comment(
                    text,
                    key_node.start_mark.line,
                    f"{orig.rel} is missing in vLLM {version}; find where it went by hand",
                )
            )
    edit_lists = _mapping_items(top["edits"][1], f"{where}: edits")
    for edit in report.broken:
        items = edit_lists[edit.rel][1]
        if not isinstance(items, yaml.SequenceNode):
            raise PatchError(f"{where}: edits[{edit.rel!r}] is not a sequence")
        item = items.value[edit.index]
        message = f"anchor occurs {edit.count} times in vLLM {version}; widen it by hand"
        changes.append(_port_comment(text, item.start_mark.line, message))
    # apply from the end so earlier indices stay valid; several insertions at one point keep
    # their order
    result = text
    for start, end, replacement in sorted(changes, key=lambda c: (c[0], c[1]), reverse=True):
        result = result[:start] + replacement + result[end:]
    return result


def write_draft(
    report: PortReport, out_dir: str | os.PathLike[str], name: str | None = None
) -> Path:
    """Copy the profile to `out_dir` as the draft for the new release; return `out_dir`.

    Refuses an `out_dir` that is a file or a non-empty directory: a draft never overwrites
    a person's work."""
    out = Path(out_dir).absolute()
    if out.exists() and not out.is_dir():
        raise PortInputError(f"{out} exists and is not a directory; choose a new directory")
    if out.is_dir() and any(out.iterdir()):
        raise PortInputError(
            f"{out} is not empty: refusing to write the draft profile over it; "
            "choose a new or empty directory"
        )
    if report.vllm_version is None:
        raise PortInputError(
            f"cannot tell the vLLM version of {report.sources} (no wheel name, no "
            f"{PACKAGE}/{VERSION_FILE}): pass --vllm-version"
        )
    version = report.vllm_version
    new_name = name or default_name(version)
    source = report.profile.directory / PROFILE_NAME
    text = draft_text(source.read_text(), report, new_name, version)
    out.parent.mkdir(parents=True, exist_ok=True)
    holder = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        staging = holder / out.name
        # copytree keeps the profile directory's modes (mkdtemp's would be 0700)
        shutil.copytree(
            report.profile.directory, staging, ignore=shutil.ignore_patterns("__pycache__")
        )
        (staging / PROFILE_NAME).write_text(text)
        try:
            drafted = load_profile(staging)
        except PatchError as exc:
            raise PatchError(f"the drafted {PROFILE_NAME} does not load ({exc}); a bug") from None
        expected = {o.rel: o.new_sha256 or o.pinned_sha256 for o in report.originals}
        if (drafted.name, drafted.vllm_version, drafted.originals) != (
            new_name,
            version,
            expected,
        ):
            raise PatchError(f"the drafted {PROFILE_NAME} does not say what was meant; a bug")
        # an empty `out` is replaced by the rename (POSIX); a non-empty one fails it
        staging.rename(out)
    except OSError as exc:
        raise PatchError(f"cannot write the draft profile to {out}: {exc}") from None
    finally:
        shutil.rmtree(holder, ignore_errors=True)
    return out
