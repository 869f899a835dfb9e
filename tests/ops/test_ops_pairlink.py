"""The pair link's reads against real servers on 127.0.0.1: the peer's own server (PairLink) and
hosts on the link network that are not the peer (tests/ops/link_servers.py)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from lab_inputs import free_port
from link_servers import ANSWER, RawServer

from sparkple.pair.pairlink import MAX_ANSWER, PairLink, mac, read_key

KEY = b"the-pair-key-0123456789abcdef"
SIDE = {"pair": "p1", "rank": 1, "role": "worker", "state": "running", "generation": 3}


def reader(port: int, key: bytes = KEY, pair: str = "p1", rank: int = 0) -> PairLink:
    """The head of pair p1 (by default), reading its worker's side."""
    return PairLink(
        f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{port}", key, pair=pair, rank=rank
    )


@pytest.fixture
def peer() -> Iterator[PairLink]:
    """The peer's real pair link, serving SIDE."""
    port = free_port()
    link = PairLink(f"127.0.0.1:{port}", "http://127.0.0.1:1", KEY, pair="p1", rank=1)
    assert link.serve() is None
    link.publish(SIDE)
    yield link
    link.close()


def test_the_peer_with_the_key_is_read(peer):
    answer = reader(peer.address[1]).fetch()
    assert answer.side == SIDE and answer.error is None


def test_before_its_first_check_the_link_answers_starting():
    port = free_port()
    starting = {"pair": "p1", "host": "spark-a", "rank": 0, "state": "starting", "updated": None}
    link = PairLink(f"127.0.0.1:{port}", "http://127.0.0.1:1", KEY, pair="p1", rank=1,
                    starting=starting)  # fmt: skip
    assert link.serve() is None
    try:
        assert reader(port).fetch().side == starting
    finally:
        link.close()


def test_the_mac_binds_the_answer_to_its_pair_and_rank(peer):
    """One key given to two pairs (or a node of this pair answering as the other rank): the
    MAC names the pair and the answering rank, so neither stands in for the peer."""
    other_pair = reader(peer.address[1], pair="p2").fetch()
    assert other_pair.side is None and "not pair p2's rank 1" in (other_pair.error or "")
    same_rank = reader(peer.address[1], rank=1).fetch()  # a worker reading a worker
    assert same_rank.side is None and "wrong MAC" in (same_rank.error or "")


def test_the_mac_frames_its_parts() -> None:
    """Each part goes in after its length: moving bytes between the nonce and the body, or
    between the pair and the rank, changes the MAC."""
    nonce, body = bytes(range(16)), b'{"a": 1}'
    assert mac(KEY, nonce, "p1", 1, body) != mac(KEY, nonce + body[:1], "p1", 1, body[1:])
    assert mac(KEY, nonce, "p1", 1, body) != mac(KEY, nonce, "p", 11, body)
    assert mac(KEY, nonce, "p1", 1, body) == mac(KEY, nonce, "p1", 1, body)


def test_a_reader_with_another_key_refuses_the_answer(peer):
    answer = reader(peer.address[1], b"another-key-0123456789abcdef").fetch()
    assert answer.side is None and "wrong MAC" in (answer.error or "")


def test_an_answer_without_a_signature_is_refused():
    """Any HTTP server on the link answering plausible JSON is not the peer."""
    with RawServer(lambda conn, req: conn.sendall(ANSWER)) as server:
        answer = reader(server.port).fetch()
    assert answer.side is None and "no MAC" in (answer.error or "")


def test_a_replayed_answer_is_refused(peer):
    """A host that recorded the peer's real answer (its MAC over the nonce of that read) and
    plays it back: the next read sends a new nonce, so the MAC does not verify."""
    with socket.create_connection(peer.address, timeout=5) as sock:
        sock.sendall(b"GET /pair?nonce=" + b"ab" * 32 + b" HTTP/1.0\r\n\r\n")
        recorded = b""
        while chunk := sock.recv(4096):
            recorded += chunk
    assert b"X-Sparkple-Pair-Mac" in recorded and json.dumps(SIDE, sort_keys=True).encode() in (
        recorded
    )
    with RawServer(lambda conn, req: conn.sendall(recorded)) as server:
        answer = reader(server.port).fetch()
    assert answer.side is None and "wrong MAC" in (answer.error or "")


def test_a_request_without_a_nonce_gets_no_answer(peer):
    with socket.create_connection(peer.address, timeout=5) as sock:
        sock.sendall(b"GET /pair HTTP/1.0\r\n\r\n")
        status = sock.recv(4096).split(b"\r\n")[0]
    assert b" 400 " in status


def test_a_trickling_answer_is_cut_at_the_deadline():
    """One byte every 0.5 s: the read ends at its 2 s deadline for the whole answer, not a
    timeout per recv (which each byte would reset, reading the whole 70 s trickle). What holds
    on any load: it never ends before the deadline, and it closes the connection long before
    the trickle ends."""
    sent: list[int] = []
    done = threading.Event()

    def counted_trickle(conn: socket.socket, request: bytes) -> None:
        try:
            for i in range(len(ANSWER)):
                conn.sendall(ANSWER[i : i + 1])  # fails once the reader has closed
                sent.append(i)
                time.sleep(0.5)
        finally:
            done.set()

    with RawServer(counted_trickle) as server:
        began = time.monotonic()
        answer = reader(server.port).fetch()
        took = time.monotonic() - began
        assert done.wait(60), "the trickle went on: the reader kept the connection open"
    assert answer.side is None and answer.error is None  # as good as no answer
    assert took >= 1.9, took
    assert len(sent) < len(ANSWER) // 2, (len(sent), len(ANSWER))


def test_an_oversize_answer_is_cut_at_the_size_bound():
    big = b"HTTP/1.0 200 OK\r\n\r\n" + b"x" * (MAX_ANSWER + 1)
    with RawServer(lambda conn, req: conn.sendall(big)) as server:
        began = time.monotonic()
        answer = reader(server.port).fetch()
    assert answer.side is None and f"more than {MAX_ANSWER} bytes" in (answer.error or "")
    assert time.monotonic() - began < 2.0


def test_a_missing_or_short_key_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"cannot read it .*serving_supervisor_pair_key"):
        read_key(tmp_path / "missing.key")
    (tmp_path / "short.key").write_text("short\n")
    with pytest.raises(ValueError, match=r"5 bytes, fewer than 16.*openssl rand -hex 32"):
        read_key(tmp_path / "short.key")
