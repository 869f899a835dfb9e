"""sparkple lab server: a stand-in for vLLM in the lab's serving image. It is NOT vLLM.

The lab target has no GB10 GPU, so the real engine cannot start. This server takes the
place of the image's entrypoint so that the service, its bind mounts and its health gate
are exercised for real:

- at start it opens the packed PLE table named by VLLM_PLE_PACKED_TABLE_DIR through
  `sparkple.table` (the package bind-mounted read-only, as for vLLM), with the geometry of
  the mounted model's config.json, and checks the patched vLLM files mounted over the
  image's own against their manifest;
- `GET /health` answers 200 only when both succeeded (503 with the reason otherwise);
- `POST /v1/completions` turns the prompt's UTF-8 bytes into token ids, looks up their
  PLE rows in the table (row ids from `sparkple.ngram`, the gather from `sparkple.gather`,
  the NVFP4 decode from `sparkple.nvfp4`) and derives each next "token" from the decoded
  rows. The text means nothing; the lookups are real.

It accepts vLLM's command line and uses --host, --port, --model and --served-model-name.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from sparkple.errors import SparkpleError
from sparkple.gather import gather_rows
from sparkple.geometry import PLEGeometry
from sparkple.ngram import row_ids
from sparkple.nvfp4 import dequantize_rows
from sparkple.table import PackedTable, open_table

# The patch output directory the service mounts read-only next to the patched files.
PATCH_DIR = Path(os.environ.get("SPARKPLE_PATCH_DIR", "/opt/sparkple/patches"))


def vllm_dir() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SparkpleError("no vllm package in this image")
    return Path(spec.submodule_search_locations[0])


def check_patches() -> str:
    """Compare each patched file, as mounted over the image's vLLM, with the manifest."""
    manifest_path = PATCH_DIR / "manifest.json"
    if not manifest_path.is_file():
        raise SparkpleError(f"no patch manifest at {manifest_path}: the patches are not mounted")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    files = manifest.get("files", [])
    if not files:
        raise SparkpleError(f"{manifest_path} lists no patched files")
    root = vllm_dir()
    for entry in files:
        target = root / entry["path"]
        digest = hashlib.sha256(target.read_bytes()).hexdigest()
        if digest != entry["patched_sha256"]:
            raise SparkpleError(
                f"{target} has sha256 {digest}, the manifest says {entry['patched_sha256']}: "
                "the patched file is not mounted over the image's"
            )
    return f"{len(files)} patched files match {manifest_path}"


class Engine:
    """The table, its geometry, and the lookups a completion does."""

    def __init__(self, model_dir: Path, table_dir: Path) -> None:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        meta_probe = open_table(table_dir)
        meta = meta_probe.meta
        meta_probe.close()
        self.geometry = PLEGeometry.from_config(
            cfg,
            stored_multipliers=list(meta.multipliers),
            stored_head_sizes=list(meta.head_sizes),
            stored_head_offsets=list(meta.head_offsets),
        )
        g = self.geometry
        self.table: PackedTable = open_table(
            table_dir,
            expect={"total_rows": g.total_rows, "num_heads": g.num_heads, "head_dim": g.head_dim},
        )
        self.rows_gathered = 0

    def complete(self, prompt: str, max_tokens: int) -> tuple[list[int], str]:
        g = self.geometry
        meta = self.table.meta
        tokens = [b % g.vocab_size for b in prompt.encode("utf-8")] or [g.eos_token_id]
        out: list[int] = []
        for _ in range(max_tokens):
            ids = np.asarray(tokens, dtype=np.int64)
            qsl = np.asarray([0, ids.size], dtype=np.int64)
            ctx = np.full((1, g.ngram_size - 1), g.eos_token_id, dtype=np.int64)
            rid = row_ids(ids, qsl, ctx, g)[-1:]  # the last token's rows
            staging = np.empty((1, g.num_heads, meta.row_width), dtype=np.uint8)
            gather_rows(self.table.rows, rid, staging)
            self.rows_gathered += int(rid.size)
            if meta.quant == "nvfp4":
                values = dequantize_rows(staging, meta.global_scale, meta.head_dim)
            else:
                values = staging.astype(np.float32)
            nxt = 32 + int(abs(float(values.sum())) * 1000) % 95  # a printable byte
            out.append(nxt)
            tokens.append(nxt)
        return out, bytes(out).decode("ascii")


class State:
    engine: Engine | None = None
    problem: str = "starting"
    model: str = ""
    patches: str = ""


def make_handler(state: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:
            sys.stderr.write("lab_server: " + (fmt % args) + "\n")

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            key = os.environ.get("VLLM_API_KEY", "")
            if key and self.headers.get("Authorization", "") != f"Bearer {key}":
                self._send(401, {"error": "missing or wrong API key"})
                return False
            return True

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/health":
                if state.engine is None:
                    self._send(503, {"error": state.problem})
                else:
                    self._send(200, {"status": "ok", "patches": state.patches})
            elif self.path == "/v1/models":
                if self._authorized():
                    self._send(200, {"object": "list", "data": [{"id": state.model}]})
            else:
                self._send(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/v1/completions":
                self._send(404, {"error": f"no route {self.path}"})
                return
            if not self._authorized():
                return
            if state.engine is None:
                self._send(503, {"error": state.problem})
                return
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                prompt = str(req.get("prompt", ""))
                max_tokens = int(req.get("max_tokens", 16))
            except (ValueError, TypeError) as exc:
                self._send(400, {"error": f"bad request body: {exc}"})
                return
            if not 1 <= max_tokens <= 256:
                self._send(400, {"error": "max_tokens must be in 1..256"})
                return
            tokens, text = state.engine.complete(prompt, max_tokens)
            prompt_tokens = max(1, len(prompt.encode("utf-8")))
            self._send(
                200,
                {
                    "id": f"cmpl-lab-{time.time_ns()}",
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": state.model,
                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": len(tokens),
                        "total_tokens": prompt_tokens + len(tokens),
                    },
                    "sparkple_lab": {
                        "stand_in": "sparkple lab server, not vLLM",
                        "ple_rows_gathered": state.engine.rows_gathered,
                        "table": str(state.engine.table.meta.data_file),
                    },
                },
            )

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name", default=None)
    args, ignored = parser.parse_known_args(argv)
    # PID 1 in a container ignores SIGTERM unless it handles it: `docker stop` must stop us,
    # also while the table is being opened
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    state = State()
    state.model = args.served_model_name or args.model
    print(f"lab_server: a stand-in for vLLM; ignoring vLLM flags {ignored}", flush=True)
    try:
        state.patches = check_patches()
        table_dir = os.environ.get("VLLM_PLE_PACKED_TABLE_DIR", "")
        if not table_dir:
            raise SparkpleError("VLLM_PLE_PACKED_TABLE_DIR is not set")
        state.engine = Engine(Path(args.model), Path(table_dir))
        state.problem = ""
        print(f"lab_server: {state.patches}; table {table_dir} open", flush=True)
    except (SparkpleError, OSError, KeyError, ValueError) as exc:
        state.problem = f"{type(exc).__name__}: {exc}"
        print(f"lab_server: not healthy: {state.problem}", file=sys.stderr, flush=True)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(state))
    print(f"lab_server: listening on {args.host}:{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
