"""`sparkple snapshot-manifest` against a local HTTP server standing in for the hub (HF_ENDPOINT).

The server answers the two routes huggingface_hub uses: the paginated tree listing
(`/api/models/<repo>/tree/<rev>`, two entries a page, with a `Link: rel="next"` header) and
`/<repo>/resolve/<rev>/<path>`. It records every request, so the tests see that the weights were
never downloaded and that the token went only into the Authorization header.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from sparkple.manifest import git_blob_id

REPO_ROOT = Path(__file__).resolve().parents[2]
REPO = "Mia-AiLab/Qwen3.8-Flash-Next-NVFP4"
REV = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_test_secret_token_value"
FILES: dict[str, tuple[bytes, bool]] = {  # path -> (content, stored in LFS)
    "config.json": (b'{"architectures": ["Qwen4ExpForConditionalGeneration"]}\n', False),
    "model.safetensors.index.json": (
        b'{"weight_map": {"a": "model-00001-of-00002.safetensors"}}',
        False,
    ),
    "model-00001-of-00002.safetensors": (os.urandom(3000), True),
    "model-00002-of-00002.safetensors": (os.urandom(5000), True),
    "tokenizer/tokenizer.json": (b'{"model": "bpe"}', False),
}


class Hub:
    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.tamper: str | None = None  # a path whose bytes are served altered
        self.fail_listing: int | None = None  # an HTTP status for the tree listing

    def entries(self) -> list[dict]:
        out = [{"type": "directory", "path": "tokenizer", "oid": "0" * 40, "size": 0}]
        for path, (data, lfs) in sorted(FILES.items()):
            entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_id(data)}
            if lfs:
                sha = hashlib.sha256(data).hexdigest()
                entry["oid"] = hashlib.sha1(f"pointer {sha}".encode()).hexdigest()
                entry["lfs"] = {"oid": sha, "size": len(data), "pointerSize": 134}
            out.append(entry)
        return out


@pytest.fixture
def hub() -> Iterator[tuple[Hub, str]]:
    state = Hub()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            url = urlsplit(self.path)
            state.requests.append(
                {
                    "path": url.path,
                    "query": parse_qs(url.query),
                    "auth": self.headers.get("Authorization"),
                }  # fmt: skip
            )
            tree = f"/api/models/{REPO}/tree/{REV}"
            resolve = f"/{REPO}/resolve/{REV}/"
            if url.path == tree:
                if state.fail_listing:
                    self.reply(state.fail_listing, b'{"error": "Repository Not Found"}')
                    return
                page = int(parse_qs(url.query).get("cursor", ["0"])[0])
                entries = state.entries()
                body = json.dumps(entries[page * 2 : page * 2 + 2]).encode()
                headers = {}
                if page * 2 + 2 < len(entries):
                    nxt = f"http://{self.headers['Host']}{tree}?cursor={page + 1}&expand=True"
                    headers["Link"] = f'<{nxt}>; rel="next"'
                self.reply(200, body, headers)
            elif url.path.startswith(resolve) and url.path[len(resolve) :] in FILES:
                path = url.path[len(resolve) :]
                data = FILES[path][0]
                self.reply(200, data + (b" " if path == state.tamper else b""))
            else:
                self.reply(404, b'{"error": "Entry not found"}')

        def reply(self, code: int, body: bytes, headers: dict | None = None) -> None:
            self.send_response(code)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def run(endpoint: str, *args: str, token: str = TOKEN) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=endpoint, HF_TOKEN=token, PYTHONPATH=str(REPO_ROOT),
               HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1")  # fmt: skip
    cmd = [sys.executable, "-m", "sparkple.cli", "snapshot-manifest", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_manifest_from_the_hubs_metadata_verifies_the_files(hub, tmp_path: Path) -> None:
    state, endpoint = hub
    out = tmp_path / "manifest.sha256"
    proc = run(endpoint, REPO, "--revision", REV, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = out.read_text().splitlines()
    assert lines == [f"{hashlib.sha256(d).hexdigest()}  {p}" for p, (d, _) in sorted(FILES.items())]
    # the real sha256sum accepts it against the files
    snap = tmp_path / "snap"
    for path, (data, _) in FILES.items():
        (snap / path).parent.mkdir(parents=True, exist_ok=True)
        (snap / path).write_bytes(data)
    check = subprocess.run(["sha256sum", "--check", "--strict", "--quiet", str(out)], cwd=snap)
    assert check.returncode == 0
    # the listing was expanded and paginated; LFS files were never downloaded
    listings = [r for r in state.requests if r["path"].startswith("/api/")]
    assert len(listings) == 3
    assert listings[0]["query"]["expand"][0].lower() == "true"
    assert listings[0]["query"]["recursive"][0].lower() == "true"
    fetched = sorted(
        r["path"].rsplit("/", 1)[-1] for r in state.requests if "/resolve/" in r["path"]
    )
    assert fetched == ["config.json", "model.safetensors.index.json", "tokenizer.json"]
    # the token went into the Authorization header only
    assert {r["auth"] for r in state.requests} == {f"Bearer {TOKEN}"}
    assert TOKEN not in proc.stdout + proc.stderr


def test_a_tampered_git_file_is_refused(hub, tmp_path: Path) -> None:
    state, endpoint = hub
    state.tamper = "config.json"
    proc = run(endpoint, REPO, "--revision", REV, "-o", str(tmp_path / "m"))
    assert proc.returncode == 1
    assert "config.json" in proc.stderr and "git blob id" in proc.stderr
    assert not (tmp_path / "m").exists()


def test_a_branch_name_is_refused(hub) -> None:
    _, endpoint = hub
    proc = run(endpoint, REPO, "--revision", "main")
    assert proc.returncode == 1
    assert "not a commit hash" in proc.stderr


def test_hub_errors_are_shown_without_the_token(hub) -> None:
    state, endpoint = hub
    state.fail_listing = 401
    proc = run(endpoint, REPO, "--revision", REV)
    assert proc.returncode == 1
    assert f"could not list {REPO}" in proc.stderr and "401" in proc.stderr
    assert TOKEN not in proc.stderr + proc.stdout
