"""A stand-in serving process for the operations tests, and a tiny service manager for it.

Like vLLM's OpenAI server it is two processes: the API front answers /health itself and hands
each /v1/completions to a separate engine process, so stopping the engine (SIGSTOP) leaves
/health at 200 while generations hang, which is what a wedged engine looks like.

  standin.py start DIR --port P [--api-key K]   start it detached, wait until /health is 200
  standin.py stop DIR                           SIGTERM, wait for exit (a graceful stop)
  standin.py is-active DIR                      exit 0 while the front process runs
  standin.py serve DIR --port P                 the front (run by start); /health is 503
                                                while DIR/health-fail exists
  standin.py engine --port Q                    the engine (run by serve)
DIR holds front.pid, engine.pid and server.log.
"""

from __future__ import annotations

import os
import sys

# `is-active` runs several times a second in the tests: it is answered before the heavier
# imports below.
if __name__ == "__main__" and sys.argv[1:2] == ["is-active"]:
    try:
        with (
            open(os.path.join(sys.argv[2], "front.pid")) as _f,
            open(f"/proc/{int(_f.read())}/stat") as _s,
        ):
            sys.exit(0 if _s.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X") else 3)
    except (OSError, ValueError):
        sys.exit(3)

import argparse  # noqa: E402
import http.server  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from pathlib import Path  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


class Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib name
        pass

    def reply(self, code: int, body: object) -> None:
        raw = json.dumps(body).encode() if not isinstance(body, str) else body.encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"{}")


def engine(port: int) -> int:
    class Engine(Quiet):
        def do_POST(self) -> None:  # noqa: N802 - stdlib name
            request = self.body()
            n = int(request.get("max_tokens", 16))
            self.reply(
                200,
                {
                    "object": "text_completion",
                    "model": request.get("model", "standin"),
                    "choices": [{"index": 0, "text": " Paris" * n, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n},
                },
            )

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Engine)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.serve_forever()
    return 0


def serve(directory: Path, port: int, api_key: str) -> int:
    engine_port = free_port()
    child = subprocess.Popen([sys.executable, __file__, "engine", "--port", str(engine_port)])
    (directory / "engine.pid").write_text(f"{child.pid}\n")
    deadline = time.monotonic() + 10  # like vLLM, /health answers once the engine is up
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", engine_port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.01)
    in_flight = [0]
    lock = threading.Lock()

    class Front(Quiet):
        def authorized(self) -> bool:
            if api_key and self.headers.get("Authorization") != f"Bearer {api_key}":
                self.reply(401, {"error": "bad api key"})
                return False
            return True

        def do_GET(self) -> None:  # noqa: N802 - stdlib name
            if self.path == "/health":
                # DIR/health-fail: /health fails as vLLM's does once its engine core is dead
                self.reply(503 if (directory / "health-fail").exists() else 200, "")
            elif self.path == "/metrics":
                self.reply(
                    200,
                    f'vllm:num_requests_running{{model_name="standin"}} {in_flight[0]}\n'
                    'vllm:num_requests_waiting{model_name="standin"} 0\n',
                )
            elif self.path == "/v1/models" and self.authorized():
                self.reply(200, {"object": "list", "data": [{"id": "standin"}]})
            elif not self.path.startswith("/v1/models"):
                self.reply(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802 - stdlib name
            if self.path != "/v1/completions":
                self.reply(404, {"error": "not found"})
                return
            if not self.authorized():
                return
            with lock:
                in_flight[0] += 1
            try:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{engine_port}/",
                    data=json.dumps(self.body()).encode(),
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(request, timeout=600) as response:
                    self.reply(200, json.loads(response.read()))
            except OSError as exc:
                self.reply(500, {"error": f"engine: {exc}"})
            finally:
                with lock:
                    in_flight[0] -= 1

    def shutdown(*_: object) -> None:
        print("stand-in: SIGTERM, stopping the engine", flush=True)
        child.terminate()
        child.wait(10)
        os._exit(0)

    signal.signal(signal.SIGTERM, shutdown)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Front)
    server.daemon_threads = True
    print(f"stand-in: serving on {port}, engine pid {child.pid}", flush=True)
    server.serve_forever()
    return 0


def start(directory: Path, port: int, api_key: str) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, __file__, "serve", str(directory), "--port", str(port)]
    if api_key:
        argv += ["--api-key", api_key]
    with open(directory / "server.log", "ab") as log:
        front = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    (directory / "front.pid").write_text(f"{front.pid}\n")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return 0
        except OSError:
            time.sleep(0.02)
        if front.poll() is not None:
            break
    print("stand-in did not become healthy", file=sys.stderr)
    return 1


def stop(directory: Path) -> int:
    pid = read_pid(directory / "front.pid")
    if pid is None or not alive(pid):
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return 0 if not alive(pid) else 1


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["start", "stop", "is-active", "serve", "engine"])
    p.add_argument("dir", type=Path, nargs="?")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--api-key", default="")
    a = p.parse_args()
    if a.command == "engine":
        return engine(a.port)
    if a.command == "serve":
        return serve(a.dir, a.port, a.api_key)
    if a.command == "start":
        return start(a.dir, a.port, a.api_key)
    if a.command == "stop":
        return stop(a.dir)
    pid = read_pid(a.dir / "front.pid")
    return 0 if pid is not None and alive(pid) else 3


if __name__ == "__main__":
    sys.exit(main())
