"""The pair link: each node's supervisor serves its side of the pair, read-only, and reads the
other's (sparkple.ops.pairing).

  GET /pair   this node's side as JSON (PAIR_FIELDS), as of its supervisor's last check

There is nothing to control over it: each supervisor acts only on its own unit, from what it
reads. The answer is the snapshot the loop published after its last check, so a request never
waits for a check or a command.
"""

from __future__ import annotations

import http.server
import json
import threading
import urllib.error
import urllib.request
from typing import Any

# The fields of a /pair answer (both sides; null where a field is the other side's).
PAIR_FIELDS = (
    "pair",  # the pair's name
    "host",  # this node
    "rank",  # 0 the head, 1 the worker
    "role",  # head | worker
    "unit_active",  # the serving unit's check command passed at the last check
    "state",  # this supervisor's state (supervisor.json)
    "manual_stop",  # this node's manual-stop flag: hands off for the pair
    "generation",  # head: the pair's launch number; worker: the launch its unit belongs to
    "want_worker",  # head: true while the worker's unit should run for `generation`
    "start_exit",  # worker: the exit status of its last start of the unit
    "incidents",  # incident markers of the last 24 h on this node: kind, time, reason
    "updated",  # when the last check ran (this node's clock)
)
FETCH_TIMEOUT_S = 2.0


def parse_listen(text: str) -> tuple[str, int]:
    """ADDRESS:PORT (an IPv6 address in brackets) -> (address, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--pair-listen {text!r}: use ADDRESS:PORT, e.g. 192.168.100.10:8470")
    return host.strip("[]"), int(port)


class PairLink:
    """This node's /pair server (a daemon thread) and a reader of the peer's."""

    def __init__(self, listen: str, peer_url: str) -> None:
        self.address = parse_listen(listen)
        self.peer_url = peer_url.rstrip("/") + "/pair"
        self._snapshot = b"{}"
        self._server: http.server.ThreadingHTTPServer | None = None

    def serve(self) -> str | None:
        """Start serving (again, after a failure); an error text while the address is not
        bindable yet (e.g. the link's interface is not up): the caller retries next check."""
        if self._server is not None:
            return None
        link = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - stdlib name
                if self.path.split("?")[0] != "/pair":
                    self.send_error(404, "only GET /pair")
                    return
                body = link._snapshot
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        try:
            server = http.server.ThreadingHTTPServer(self.address, Handler)
        except OSError as exc:
            return f"cannot listen on {self.address[0]}:{self.address[1]} ({exc})"
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="pair-link", daemon=True).start()
        self._server = server
        return None

    def publish(self, side: dict[str, Any]) -> None:
        # one reference swap: a request in flight sends the old or the new answer, whole
        self._snapshot = json.dumps(side, sort_keys=True).encode()

    def fetch(self) -> dict[str, Any] | None:
        """The peer's side, or None when it did not answer with a JSON object."""
        try:
            with urllib.request.urlopen(self.peer_url, timeout=FETCH_TIMEOUT_S) as response:
                data = json.loads(response.read(1 << 20))
        except (OSError, ValueError, urllib.error.URLError):
            return None
        return data if isinstance(data, dict) else None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
