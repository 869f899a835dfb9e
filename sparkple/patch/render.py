"""Render a profile: originals checked against their pins, edits applied at their anchors,
added files rendered, every result parsed, and OUT replaced all at once."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..errors import PatchError
from .profile import (
    PATCH_MARKER,
    PROFILE_NAME,
    PROFILES_DIR,
    Edit,
    Profile,
    load_profile,
    resolve_variables,
    sha256_bytes,
)

if TYPE_CHECKING:  # jinja2 is imported only when a profile is rendered
    import jinja2

MANIFEST_NAME = "manifest.json"


def py_literal(value: Any) -> str:
    """A Python literal for a rendered value, double-quoted like the formatter wants."""
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def _jinja_env(profile: Profile) -> jinja2.Environment:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(profile.directory)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["py"] = py_literal
    return env


def _render_template(env: jinja2.Environment, template: str, context: dict[str, Any]) -> str:
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


def _profiles_pinning(rel: str, digest: str) -> str:
    """Where another shipped profile pins this very file: the profile to render instead."""
    matches = []
    for directory in sorted(PROFILES_DIR.glob(f"*/{PROFILE_NAME}")):
        other = load_profile(directory.parent)
        if other.originals.get(rel) == digest:
            matches.append(f"{other.name} (vLLM {other.vllm_version})")
    if not matches:
        return "; no profile here pins it: port one with `sparkple patch port`"
    return (
        f"; it is the file of profile {' and '.join(matches)}: render that profile "
        "(the roles' knob: vllm_patches_profile)"
    )


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
                + _profiles_pinning(rel, actual)
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
