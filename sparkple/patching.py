"""Render a vLLM patch profile against original vLLM sources, and check a deployed result.

A profile is a directory `templates/vllm/<name>/` holding `profile.yml` and Jinja templates.
`render` refuses to write anything unless every original matches its pinned sha256, every
edit's anchor occurs exactly once, no file already carries the patch marker, and every
result parses as Python. The output appears in OUT only when all of that succeeded (it is
written to a temporary sibling directory and renamed into place), together with
`manifest.json`, which `check` later compares a deployed directory against.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import __version__
from .errors import PatchError

MANIFEST_NAME = "manifest.json"
PROFILE_NAME = "profile.yml"
# Every rendered file carries this marker; an original that has it was patched before.
PATCH_MARKER = "sparkple-patch"
# The profiles shipped with the checkout: <repo>/templates/vllm/<name>/.
PROFILES_DIR = Path(__file__).resolve().parent.parent / "templates" / "vllm"
EDIT_MODES = ("insert_before", "insert_after", "replace")
VAR_TYPES = ("int", "float", "str", "choice")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    return sha256_bytes(path.read_bytes())


# --------------------------------------------------------------------------- profile


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


def _require(data: dict, key: str, kind: type, where: str) -> Any:
    if key not in data:
        raise PatchError(f"{where}: missing key {key!r}")
    if not isinstance(data[key], kind):
        raise PatchError(f"{where}: {key!r} must be a {kind.__name__}, got {data[key]!r}")
    return data[key]


def _require_choice(data: dict, key: str, choices: tuple[str, ...], where: str) -> str:
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


# --------------------------------------------------------------------------- render


def py_literal(value: Any) -> str:
    """A Python literal for a rendered value, double-quoted like the formatter wants."""
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def _jinja_env(profile: Profile):
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(profile.directory)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["py"] = py_literal
    return env


def _render_template(env, template: str, context: dict[str, Any]) -> str:
    import jinja2

    try:
        return env.get_template(template).render(**context)
    except jinja2.TemplateError as exc:
        raise PatchError(f"template {template} failed to render: {exc}") from None


def apply_edits(rel: str, original: str, edits: list[tuple[Edit, str]]) -> str:
    """Apply each (edit, rendered text) at its anchor, which must occur exactly once."""
    spans = []
    for edit, text in edits:
        count = original.count(edit.anchor)
        if count != 1:
            raise PatchError(
                f"{rel}: the anchor of edit {edit.template} occurs {count} times, "
                "expected exactly once; the original is not the file this profile was made for"
            )
        start = original.index(edit.anchor)
        spans.append((start, start + len(edit.anchor), edit, text))
    spans.sort(key=lambda span: span[0])
    for (_, end, first, _), (start, _, second, _) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise PatchError(
                f"{rel}: the anchors of {first.template} and {second.template} overlap"
            )
    result = original
    for start, end, edit, text in reversed(spans):
        if edit.mode == "insert_before":
            result = result[:start] + text + result[start:]
        elif edit.mode == "insert_after":
            result = result[:end] + text + result[end:]
        else:
            result = result[:start] + text + result[end:]
    return result


def _check_python(rel: str, text: str) -> None:
    try:
        ast.parse(text, filename=rel)
    except SyntaxError as exc:
        raise PatchError(
            f"{rel}: the patched file is not valid Python (line {exc.lineno}: {exc.msg}); "
            "nothing was written"
        ) from None


def render_files(
    profile: Profile, originals_dir: Path, variables: dict[str, Any]
) -> tuple[dict[str, str], dict[str, Any]]:
    """Return {relative path: text} for every patched and added file, and the manifest."""
    originals_dir = Path(originals_dir)
    texts: dict[str, str] = {}
    for rel, pinned in profile.originals.items():
        path = originals_dir / rel
        if not path.is_file():
            raise PatchError(
                f"original {rel} is missing under {originals_dir}; copy it out of "
                f"{profile.image} (paths are relative to the vllm package)"
            )
        data = path.read_bytes()
        actual = sha256_bytes(data)
        text = data.decode("utf-8")
        if actual != pinned:
            hint = (
                "it already carries the sparkple patch; pass the image's pristine originals"
                if PATCH_MARKER in text
                else f"this is not the file shipped in vLLM {profile.vllm_version}"
            )
            raise PatchError(
                f"{rel}: sha256 {actual} does not match the pinned {pinned} "
                f"of profile {profile.name}: {hint}"
            )
        texts[rel] = text

    env = _jinja_env(profile)
    context = {"var": variables, "profile": profile, "marker": PATCH_MARKER}
    outputs: dict[str, str] = {}
    for rel, edits in profile.edits.items():
        if PATCH_MARKER in texts[rel]:
            raise PatchError(f"{rel} is already patched (it carries {PATCH_MARKER!r})")
        rendered = [(edit, _render_template(env, edit.template, context)) for edit in edits]
        for edit, text in rendered:
            if PATCH_MARKER not in text:
                raise PatchError(f"template {edit.template} must carry the {PATCH_MARKER} marker")
        outputs[rel] = apply_edits(rel, texts[rel], rendered)
    for rel, template in profile.added.items():
        outputs[rel] = _render_template(env, template, context)
        if PATCH_MARKER not in outputs[rel]:
            raise PatchError(f"template {template} must carry the {PATCH_MARKER} marker")
    for rel, text in outputs.items():
        _check_python(rel, text)

    files = []
    for rel in sorted(outputs):
        template_hash = hashlib.sha256()
        for template in profile.template_paths(rel):
            template_hash.update((profile.directory / template).read_bytes())
        files.append(
            {
                "path": rel,
                "kind": "added" if rel in profile.added else "patched",
                "original_sha256": profile.originals.get(rel),  # render_files checked it
                "template_sha256": template_hash.hexdigest(),
                "patched_sha256": sha256_bytes(outputs[rel].encode()),
            }
        )
    manifest = {
        "profile": profile.name,
        "vllm_version": profile.vllm_version,
        "image": profile.image,
        "sparkple_version": __version__,
        "variables": variables,
        "env": profile.env,
        "files": files,
    }
    return outputs, manifest


def _write_tree(root: Path, outputs: dict[str, str], manifest: dict[str, Any]) -> None:
    for rel, text in outputs.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def render(
    profile: str | os.PathLike[str],
    originals_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    overrides: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Render `profile` against `originals_dir` into `out_dir` (all or nothing); return manifest."""
    loaded = load_profile(profile)
    variables = resolve_variables(loaded, overrides or {})
    outputs, manifest = render_files(loaded, Path(originals_dir), variables)
    out = Path(out_dir).absolute()
    if out.exists() and not out.is_dir():
        raise PatchError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST_NAME).is_file():
        raise PatchError(
            f"{out} is not empty and holds no {MANIFEST_NAME}: refusing to replace files "
            "sparkple did not write; choose an empty or new directory"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_tree(staging, outputs, manifest)
        if out.exists():
            # Replace an earlier render: move it aside first so OUT is never half-written.
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            old.rmdir()
            out.rename(old)
            staging.rename(out)
            shutil.rmtree(old)
        else:
            staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return manifest


# --------------------------------------------------------------------------- check


def check(out_dir: str | os.PathLike[str]) -> list[str]:
    """Compare a deployed directory against its manifest; return the problems (empty: OK)."""
    out = Path(out_dir)
    manifest_path = out / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{manifest_path}: no readable manifest ({exc})"]
    problems = []
    listed = set()
    for entry in files:
        rel = entry["path"]
        listed.add(rel)
        path = out / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
            continue
        actual = sha256_file(path)
        if actual != entry["patched_sha256"]:
            problems.append(
                f"{rel}: sha256 {actual} differs from the manifest's {entry['patched_sha256']}"
            )
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out).as_posix()
        if path.is_file() and rel != MANIFEST_NAME and rel not in listed:
            problems.append(f"{rel}: not in the manifest")
    return problems


# --------------------------------------------------------------------------- CLI


def _cmd_render(args: argparse.Namespace) -> int:
    manifest = render(args.profile, args.originals, args.out, parse_var_args(args.var))
    for entry in manifest["files"]:
        print(f"{entry['kind']:8} {entry['path']}  {entry['patched_sha256']}")
    print(f"rendered {manifest['profile']} (vLLM {manifest['vllm_version']}) into {args.out}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    problems = check(args.out)
    for problem in problems:
        print(problem)
    if problems:
        print(f"{args.out}: {len(problems)} problem(s); re-render with `sparkple patch render`")
        return 1
    print(f"{args.out}: every file matches {MANIFEST_NAME}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> None:
    parser = subparsers.add_parser(name, help="render and check vLLM patch profiles")
    actions = parser.add_subparsers(dest="patch_command", metavar="ACTION", required=True)
    render_p = actions.add_parser("render", help="render a profile against original vLLM files")
    render_p.add_argument("--profile", required=True, help="profile name or directory")
    render_p.add_argument(
        "--originals", required=True, help="directory of originals, relative to the vllm package"
    )
    render_p.add_argument("--out", required=True, help="directory that receives the result")
    render_p.add_argument(
        "--var", action="append", default=[], metavar="NAME=VALUE", help="template variable"
    )
    render_p.set_defaults(func=_cmd_render)
    check_p = actions.add_parser("check", help="verify a rendered directory against its manifest")
    check_p.add_argument("out", help="directory written by `sparkple patch render`")
    check_p.set_defaults(func=_cmd_check)
