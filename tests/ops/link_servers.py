"""Hosts on the pair link that are not the peer, for the pair link's tests: a raw TCP server
that reads each HTTP request and answers it with a function of the request (nothing of
sparkple's own server code)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

from lab_inputs import free_port

Respond = Callable[[socket.socket, bytes], None]


class RawServer:
    """Listens on 127.0.0.1:<port>; every connection gets `respond(conn, request)`."""

    def __init__(self, respond: Respond) -> None:
        self.respond = respond
        self.port = free_port()
        self.requests = 0
        self.sock = socket.create_server(("127.0.0.1", self.port))
        self.sock.settimeout(0.2)
        self.stopped = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(5)
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                request += chunk
            self.requests += 1
            self.respond(conn, request)

    def __enter__(self) -> RawServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.sock.close()


ANSWER = (
    b'HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{"pair": "p1", "rank": 1, '
    b'"role": "worker", "state": "running", "unit_active": true, "generation": 1}'
)


def trickle(conn: socket.socket, request: bytes) -> None:
    """One byte of a plausible answer every 0.5 s (about 70 s in all)."""
    for i in range(len(ANSWER)):
        conn.sendall(ANSWER[i : i + 1])
        time.sleep(0.5)
