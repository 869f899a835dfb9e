"""The profile schema: `profile.yml` read, validated and turned into typed objects."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..errors import PatchError

PROFILE_NAME = "profile.yml"
# Every rendered file carries this marker; an original that has it was patched before.
PATCH_MARKER = "sparkple-patch"
# The profiles shipped with the checkout: <repo>/templates/vllm/<name>/.
PROFILES_DIR = Path(__file__).resolve().parents[2] / "templates" / "vllm"
# The profile every role, inventory and test takes unless told otherwise (the roles' knob:
# vllm_patches_profile); the profiles before it stay supported for rollbacks.
DEFAULT_PROFILE = "vllm-0.34"
EDIT_MODES = ("insert_before", "insert_after", "replace")
VAR_TYPES = ("int", "float", "str", "choice")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    return sha256_bytes(path.read_bytes())


@dataclass(frozen=True)
class Variable:
    name: str
    type: str
    default: Any
    description: str
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] = ()

    def coerce(self, raw: Any) -> Any:
        """Turn `raw` (a string from the command line, or a YAML value) into a checked value."""
        where = f"template variable {self.name!r}"
        try:
            if self.type == "int":
                if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                    raise ValueError(raw)
                value: Any = int(raw)
            elif self.type == "float":
                if isinstance(raw, bool):
                    raise ValueError(raw)
                value = float(raw)
            else:
                value = str(raw)
        except (TypeError, ValueError):
            raise PatchError(f"{where} must be {self.type}, got {raw!r}") from None
        if self.type == "choice" and value not in self.choices:
            raise PatchError(f"{where} must be one of {', '.join(self.choices)}; got {value!r}")
        if self.min is not None and value < self.min:
            raise PatchError(f"{where} must be >= {self.min}, got {value!r}")
        if self.max is not None and value > self.max:
            raise PatchError(f"{where} must be <= {self.max}, got {value!r}")
        return value


@dataclass(frozen=True)
class Edit:
    anchor: str
    mode: str
    template: str


@dataclass(frozen=True)
class Profile:
    name: str
    directory: Path
    vllm_version: str
    image: str
    originals: dict[str, str]  # relative path -> sha256 of the file as shipped
    edits: dict[str, list[Edit]]  # relative path -> its edits, applied in order
    added: dict[str, str]  # relative path -> template that renders the whole file
    env: dict[str, dict[str, Any]]
    variables: dict[str, Variable] = field(default_factory=dict)

    def template_paths(self, rel: str) -> list[str]:
        return _template_paths(rel, self.edits, self.added)


def _template_paths(rel: str, edits: dict[str, list[Edit]], added: dict[str, str]) -> list[str]:
    if rel in added:
        return [added[rel]]
    return [edit.template for edit in edits.get(rel, [])]


T = TypeVar("T")


def _require(data: dict[str, Any], key: str, kind: type[T], where: str) -> T:
    if key not in data:
        raise PatchError(f"{where}: missing key {key!r}")
    value = data[key]
    if not isinstance(value, kind):
        raise PatchError(f"{where}: {key!r} must be a {kind.__name__}, got {value!r}")
    return value


def _require_choice(data: object, key: str, choices: tuple[str, ...], where: str) -> str:
    if not isinstance(data, dict):
        raise PatchError(f"{where} must be a mapping")
    value = _require(data, key, str, where)
    if value not in choices:
        raise PatchError(f"{where}: {key} must be one of {', '.join(choices)}")
    return value


def resolve_profile_dir(profile: str | os.PathLike[str]) -> Path:
    """A profile is named (`vllm-0.33`, looked up under templates/vllm/) or given as a path."""
    text = os.fspath(profile)
    candidate = Path(text)
    if os.sep not in text and not candidate.is_dir():
        candidate = PROFILES_DIR / text
    if not (candidate / PROFILE_NAME).is_file():
        known = sorted(p.name for p in PROFILES_DIR.glob("*") if (p / PROFILE_NAME).is_file())
        raise PatchError(
            f"no patch profile at {candidate} (it needs a {PROFILE_NAME}); "
            f"known profiles: {', '.join(known) or 'none'}"
        )
    return candidate


def load_profile(profile: str | os.PathLike[str]) -> Profile:
    import yaml

    directory = resolve_profile_dir(profile)
    where = str(directory / PROFILE_NAME)
    try:
        data = yaml.safe_load((directory / PROFILE_NAME).read_text())
    except yaml.YAMLError as exc:
        raise PatchError(f"{where} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise PatchError(f"{where} must hold a mapping")
    originals = _require(data, "originals", dict, where)
    for rel, digest in originals.items():
        if not (isinstance(digest, str) and len(digest) == 64):
            raise PatchError(f"{where}: originals[{rel!r}] must be a sha256 hex digest")
    edits: dict[str, list[Edit]] = {}
    for rel, items in _require(data, "edits", dict, where).items():
        if rel not in originals:
            raise PatchError(f"{where}: edited file {rel!r} has no pinned original")
        if not isinstance(items, list) or not items:
            raise PatchError(f"{where}: edits[{rel!r}] must be a non-empty list")
        parsed = []
        for i, item in enumerate(items):
            ewhere = f"{where}: edits[{rel!r}][{i}]"
            mode = _require_choice(item, "mode", EDIT_MODES, ewhere)
            parsed.append(
                Edit(
                    anchor=_require(item, "anchor", str, ewhere),
                    mode=mode,
                    template=_require(item, "template", str, ewhere),
                )
            )
        edits[rel] = parsed
    added = _require(data, "added", dict, where)
    for rel in added:
        if rel in originals:
            raise PatchError(f"{where}: added file {rel!r} would overwrite a vLLM original")
    variables = {}
    for name, spec in _require(data, "variables", dict, where).items():
        vwhere = f"{where}: variables[{name!r}]"
        var = Variable(
            name=name,
            type=_require_choice(spec, "type", VAR_TYPES, vwhere),
            default=spec.get("default"),
            description=_require(spec, "description", str, vwhere),
            min=spec.get("min"),
            max=spec.get("max"),
            choices=tuple(spec.get("choices", ())),
        )
        var.coerce(var.default)  # a profile whose own default is invalid is a bug
        variables[name] = var
    for rel in list(edits) + list(added):
        for template in _template_paths(rel, edits, added):
            if not (directory / template).is_file():
                raise PatchError(f"{where}: template {template!r} for {rel!r} does not exist")
    return Profile(
        name=_require(data, "name", str, where),
        directory=directory,
        vllm_version=_require(data, "vllm_version", str, where),
        image=_require(data, "image", str, where),
        originals=originals,
        edits=edits,
        added=added,
        env=_require(data, "env", dict, where),
        variables=variables,
    )


def resolve_variables(profile: Profile, overrides: dict[str, str]) -> dict[str, Any]:
    """Profile defaults, overridden by NAME=VALUE pairs, each checked against its spec."""
    unknown = sorted(set(overrides) - set(profile.variables))
    if unknown:
        raise PatchError(
            f"unknown template variable(s) {', '.join(unknown)} for profile {profile.name}; "
            f"known: {', '.join(sorted(profile.variables))}"
        )
    return {
        name: var.coerce(overrides.get(name, var.default))
        for name, var in sorted(profile.variables.items())
    }


def parse_var_args(pairs: list[str]) -> dict[str, str]:
    result: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise PatchError(f"--var takes NAME=VALUE, got {pair!r}")
        result[name.strip()] = value.strip()
    return result
