"""The pair link: each node's supervisor serves its side of the pair, read-only, and reads the
other's (sparkple.pair.member).

  GET /pair?nonce=HEX   this node's side as JSON (PAIR_FIELDS), as of its supervisor's last
                        check, with X-Sparkple-Pair-Mac: the answer's MAC (see `mac`)

The link serves no command, but what it carries steers the pair: the worker starts and stops
its serving unit from the head's `want_worker` and `generation`, and each side stops serving
when the other's release differs. So an answer counts only when it comes from the peer itself:
the answer is the snapshot the loop published after its last check (a request never waits for
a check or a command; before the first check ends the snapshot says so: state "starting", with
the pair, host, rank and role, and nothing else known yet).

The link is authenticated with the pair's shared key (the inventory's vault, one key for each
pair, a 0600 file on each node): the reader sends a fresh random nonce and takes the answer
only when its MAC verifies. The MAC covers, each with its length, the protocol's name, the
nonce, the pair's name, the answering node's rank and the body: a host on the link network
without the key cannot answer as the peer, a replay of an earlier answer fails, an answer
cannot be re-cut into another nonce and body, and a node of another pair (or this pair's other
rank) cannot stand in for the peer even where two pairs were given one key. A read is bounded
in total time and in size: a peer that trickles its answer, or sends too much, is a peer that
did not answer.
"""

from __future__ import annotations

import hashlib
import hmac
import http.server
import json
import secrets
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The fields of a /pair answer (both sides; null where a field is the other side's).
PAIR_FIELDS = (
    "pair",  # the pair's name
    "host",  # this node
    "rank",  # 0 the head, 1 the worker
    "role",  # head | worker
    "unit_active",  # the serving unit's check command passed at the last check
    "state",  # this supervisor's state (supervisor.json); "starting" before its first check
    "manual_stop",  # this node's manual-stop flag: hands off for the pair
    "generation",  # head: the pair's launch number; worker: the launch its unit belongs to
    "want_worker",  # head: true while the worker's unit should run for `generation`
    "start_exit",  # worker: the exit status of its last start of the unit
    "incidents",  # incident markers of the last 24 h on this node: kind, time, reason
    "release",  # the node's current release id (its release.json), null without one
    "patch_manifest_sha256",  # that release's patch manifest hash ("" without patches)
    "updated",  # when the last check ran (this node's clock); null: not checked yet
)
MAC_HEADER = "X-Sparkple-Pair-Mac"
FETCH_DEADLINE_S = 2.0  # the whole read: connect, request, answer
MAX_ANSWER = 64 * 1024  # bytes, headers and body together
MIN_KEY_BYTES = 16


def parse_listen(text: str) -> tuple[str, int]:
    """ADDRESS:PORT (an IPv6 address in brackets) -> (address, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--pair-listen {text!r}: use ADDRESS:PORT, e.g. 192.168.100.10:8470")
    return host.strip("[]"), int(port)


def read_key(path: Path) -> bytes:
    """The pair's shared key from its file (surrounding whitespace dropped)."""
    try:
        key = path.read_bytes().strip()
    except OSError as exc:
        raise ValueError(
            f"--pair-key-file {path}: cannot read it ({exc.strerror}); set "
            "serving_supervisor_pair_key in the inventory's vault and rerun site.yml"
        ) from exc
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"--pair-key-file {path}: the pair's key has {len(key)} bytes, fewer than "
            f"{MIN_KEY_BYTES}; set serving_supervisor_pair_key (the same on both nodes of the "
            "pair, e.g. `openssl rand -hex 32`) in the inventory's vault"
        )
    return key


# the MAC's domain: another protocol's MAC under the same key is never one of these
MAC_CONTEXT = b"sparkple-pair-link/2"


def mac(key: bytes, nonce: bytes, pair: str, rank: int, body: bytes) -> str:
    """HMAC-SHA256 over the context, the nonce, the pair, the answering rank and the body, each
    after its length (8 bytes, big-endian): no two different tuples give the same message."""
    message = b"".join(
        len(part).to_bytes(8, "big") + part
        for part in (MAC_CONTEXT, nonce, pair.encode(), str(rank).encode(), body)
    )
    return hmac.new(key, message, hashlib.sha256).hexdigest()


@dataclass
class Answer:
    """A read of the peer's side: `side` when it answered as the peer, else `error` (None
    when nothing answered at all, a text when something answered that is not the peer)."""

    side: dict[str, Any] | None = None
    error: str | None = None


class PairLink:
    """This node's /pair server (a daemon thread) and a reader of the peer's."""

    def __init__(
        self,
        listen: str,
        peer_url: str,
        key: bytes,
        *,
        pair: str,
        rank: int,
        starting: dict[str, Any] | None = None,
    ) -> None:
        """This node is `rank` of `pair`: it signs its answers as that, and takes answers only
        as the other rank of the same pair."""
        if rank not in (0, 1):
            raise ValueError(f"pair rank {rank!r}: a pair's ranks are 0 (head) and 1 (worker)")
        self.pair, self.rank, self.peer_rank = pair, rank, 1 - rank
        self.address = parse_listen(listen)
        self.peer_url = peer_url.rstrip("/") + "/pair"
        parsed = urllib.parse.urlsplit(self.peer_url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"--pair-peer-url {peer_url!r}: use http://ADDRESS:PORT")
        self.peer_address = (parsed.hostname, parsed.port or 80)
        self.key = key
        self._snapshot = json.dumps(starting or {}, sort_keys=True).encode()
        self._server: http.server.ThreadingHTTPServer | None = None

    def serve(self) -> str | None:
        """Start serving (again, after a failure); an error text while the address is not
        bindable yet (e.g. the link's interface is not up): the caller retries next check."""
        if self._server is not None:
            return None
        link = self

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = FETCH_DEADLINE_S  # a client that never sends its request is dropped

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - stdlib name
                url = urllib.parse.urlsplit(self.path)
                if url.path != "/pair":
                    self.send_error(404, "only GET /pair")
                    return
                nonce = urllib.parse.parse_qs(url.query).get("nonce", [""])[0]
                try:
                    raw = bytes.fromhex(nonce)
                except ValueError:
                    raw = b""
                if not 16 <= len(raw) <= 64:
                    self.send_error(400, "GET /pair?nonce=HEX (16 to 64 random bytes)")
                    return
                body = link._snapshot
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header(MAC_HEADER, mac(link.key, raw, link.pair, link.rank, body))
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

    def fetch(self) -> Answer:
        """The peer's side, read within FETCH_DEADLINE_S and MAX_ANSWER bytes, verified."""
        nonce = secrets.token_bytes(32)
        try:
            raw = self._read(nonce.hex())
        except (OSError, TimeoutError):
            return Answer()
        if raw is None:
            return Answer(error=f"{self.peer_url} sent more than {MAX_ANSWER} bytes")
        if raw == b"":
            return Answer()  # slower than the deadline: as good as no answer
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        if not lines[0].startswith("HTTP/") or lines[0].split(" ")[1:2] != ["200"]:
            return Answer(error=f"{self.peer_url} answered {lines[0][:80]!r}, not 200")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        signature = headers.get(MAC_HEADER.lower(), "")
        if not hmac.compare_digest(
            signature, mac(self.key, nonce, self.pair, self.peer_rank, body)
        ):
            what = "a wrong" if signature else "no"
            return Answer(
                error=f"{self.peer_url} answered with {what} MAC for this read: not pair "
                f"{self.pair}'s rank {self.peer_rank} (another host or pair, an old answer "
                "replayed, or a different serving_supervisor_pair_key on the two nodes)"
            )
        try:
            data = json.loads(body)
        except ValueError:
            return Answer(error=f"{self.peer_url} answered a body that is not JSON")
        if not isinstance(data, dict):
            return Answer(error=f"{self.peer_url} answered JSON that is not an object")
        return Answer(side=data)

    def _read(self, nonce: str) -> bytes | None:
        """The whole raw answer (HTTP/1.0: the server closes after it); b"" when the deadline
        passed first, None when it grew past MAX_ANSWER. The deadline covers the whole read:
        each recv waits only for what is left of it."""
        deadline = time.monotonic() + FETCH_DEADLINE_S
        host, port = self.peer_address
        with socket.create_connection((host, port), timeout=FETCH_DEADLINE_S) as sock:
            request = f"GET /pair?nonce={nonce} HTTP/1.0\r\nHost: {host}:{port}\r\n\r\n"
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(request.encode())
            chunks: list[bytes] = []
            size = 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return b""
                sock.settimeout(left)
                try:
                    chunk = sock.recv(16384)
                except TimeoutError:
                    return b""
                if not chunk:
                    return b"".join(chunks)
                size += len(chunk)
                if size > MAX_ANSWER:
                    return None
                chunks.append(chunk)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
