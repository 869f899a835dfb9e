"""`sparkple snapshot-manifest`: a sha256 manifest of a hub revision, from the hub's metadata.

The hub publishes the sha256 of every LFS file of a revision (`list_repo_tree(...,
expand=True)` in `huggingface_hub`): the weights need not be downloaded to know what they must
hash to. Small files kept in git (config.json, the index, tokenizer files) carry only their git
blob id; they are fetched (a few MB at most), checked against that id, and hashed. The output is
`sha256sum` format (`<sha256>  <path>`, sorted by path), what `model_checkpoint` verifies the
downloaded snapshot against with `sha256sum --check --strict`.

The revision must be a commit hash: a branch moves, a manifest must not. HF_ENDPOINT (or
--endpoint) names the hub; HF_TOKEN is read from the environment, never from the command line.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

from .errors import EXIT_OK, SparkpleError

COMMIT = re.compile(r"^[0-9a-f]{40}$")
REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Git-stored files above this size are refused (the hub puts anything big in LFS).
MAX_GIT_FILE_BYTES = 64 * 1024 * 1024


class ManifestError(SparkpleError):
    """The hub's metadata cannot give a trustworthy manifest."""


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _scrub(text: str, token: str | None) -> str:
    return text.replace(token, "***") if token else text


def manifest_lines(
    repo: str, revision: str, *, endpoint: str | None = None, token: str | None = None
) -> list[str]:
    """`<sha256>  <path>` for every file of the revision, sorted by path."""
    if not REPO.match(repo):
        raise ManifestError(f"{repo!r} is not a hub repository name: use OWNER/NAME")
    if not COMMIT.match(revision):
        raise ManifestError(
            f"revision {revision!r} is not a commit hash: pin the 40-hex commit of the snapshot "
            "(the repository's history on the hub lists them); a branch can move"
        )
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_backoff
    except ImportError:
        raise ManifestError(
            "huggingface_hub is not installed: pip install 'huggingface_hub>=1.0' "
            "(the serving image has it)"
        ) from None
    api = HfApi(endpoint=endpoint, token=token or False)
    try:
        entries = list(api.list_repo_tree(repo, revision=revision, recursive=True, expand=True))
    except Exception as exc:  # noqa: BLE001 - any hub failure becomes one clear message
        raise ManifestError(
            f"could not list {repo} at {revision} on {api.endpoint}: "
            f"{_scrub(f'{type(exc).__name__}: {exc}', token)}"
        ) from None
    files = [e for e in entries if isinstance(e, RepoFile)]
    if not files:
        raise ManifestError(f"{repo} at {revision} lists no files on {api.endpoint}")
    lines = []
    headers = build_hf_headers(token=token or False)
    for entry in sorted(files, key=lambda e: e.path):
        if entry.path.startswith("/") or ".." in entry.path.split("/") or "\n" in entry.path:
            raise ManifestError(f"the hub listed an unsafe path {entry.path!r}")
        lfs: Any = getattr(entry, "lfs", None)
        if lfs is not None:
            digest = str(lfs.sha256)
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ManifestError(f"{entry.path}: the hub's LFS sha256 {digest!r} is malformed")
        else:
            if entry.size > MAX_GIT_FILE_BYTES:
                raise ManifestError(f"{entry.path}: {entry.size} B in git without LFS metadata")
            url = f"{api.endpoint}/{repo}/resolve/{revision}/{quote(entry.path, safe='/')}"
            try:
                response = http_backoff("GET", url, headers=headers)
                hf_raise_for_status(response)
            except Exception as exc:  # noqa: BLE001
                raise ManifestError(
                    f"could not fetch {entry.path} of {repo} at {revision}: "
                    f"{_scrub(f'{type(exc).__name__}: {exc}', token)}"
                ) from None
            data = response.content
            if git_blob_id(data) != entry.blob_id:
                raise ManifestError(
                    f"{entry.path}: the fetched bytes do not match the hub's git blob id "
                    f"{entry.blob_id}: a proxy altered it, or the revision changed; try again"
                )
            digest = hashlib.sha256(data).hexdigest()
        lines.append(f"{digest}  {entry.path}")
    return lines


def write_manifest(lines: list[str], output: Path) -> None:
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(tmp, output)


def _run(args: argparse.Namespace) -> int:
    token = os.environ.get("HF_TOKEN") or None
    lines = manifest_lines(args.repo, args.revision, endpoint=args.endpoint, token=token)
    if args.output:
        write_manifest(lines, Path(args.output))
        print(f"sparkple snapshot-manifest: {len(lines)} files -> {args.output}", file=sys.stderr)
    else:
        sys.stdout.write("".join(line + "\n" for line in lines))
    return EXIT_OK


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name, help="sha256 manifest of a hub revision from the hub's metadata (no download)"
    )
    p.add_argument("repo", help="OWNER/NAME on the hub")
    p.add_argument("--revision", required=True, help="the commit hash (40 hex) to pin")
    p.add_argument("--output", "-o", help="write the manifest here (default: stdout)")
    p.add_argument("--endpoint", default=None, help="the hub's URL (default: HF_ENDPOINT)")
    p.set_defaults(func=_run)
