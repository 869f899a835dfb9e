"""The lab server streams as vLLM's OpenAI server does, and counts its requests as vLLM does.

`"stream": true` is answered with server-sent events (one chunk per token, the last with its
finish_reason, an optional usage chunk, then `data: [DONE]`); SPARKPLE_LAB_TOKEN_DELAY_S makes
each token take time; --max-num-seqs bounds the running requests and /metrics shows the
running and waiting ones under vLLM's gauge names. Orderings are asserted, not durations.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from http.client import HTTPResponse

from ops_helpers import wait_for
from test_lab_server import engine_of, health, lab_server, request  # noqa: F401

MODEL = "qwen3.8-flash-next"


def open_stream(port: int, body: dict, path: str = "/v1/completions") -> HTTPResponse:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=30)


def events(resp: HTTPResponse) -> list[str]:
    """The `data:` payloads of an event stream, in order, up to the end of the stream."""
    out = []
    for raw in resp:
        line = raw.decode().rstrip("\n")
        if line.startswith("data: "):
            out.append(line[len("data: ") :])
        else:
            assert line == "", f"not an event-stream line: {line!r}"
    return out


def gauges(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        # the scheduler's gauges (the lab exports vLLM's token and latency series beside them)
        if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")):
            name, value = line.rsplit(" ", 1)
            assert name.endswith(f'{{engine="0",model_name="{MODEL}"}}'), name
            values[name.split("{", 1)[0]] = float(value)
    return values


def test_a_completion_streams_one_chunk_per_token(lab_server) -> None:  # noqa: F811
    _, port = lab_server(extra_args=[f"--served-model-name={MODEL}"])
    wait_for(lambda: health(port) == 200, 30, "/health 200")
    body = {"model": MODEL, "prompt": "hello spark", "max_tokens": 7}
    with open_stream(port, {**body, "stream_options": {"include_usage": True}}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        data = events(resp)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    tokens, usage = chunks[:-1], chunks[-1]
    assert len(tokens) == 7
    for i, chunk in enumerate(tokens):
        assert chunk["object"] == "text_completion" and chunk["model"] == MODEL
        assert chunk["id"] == tokens[0]["id"] and chunk["id"].startswith("cmpl-")
        (choice,) = chunk["choices"]
        assert len(choice["text"]) == 1
        assert choice["finish_reason"] == ("length" if i == 6 else None)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 7
    # the same text as the answer in one piece
    code, whole = request(port, "/v1/completions", body)
    assert code == 200
    assert "".join(c["choices"][0]["text"] for c in tokens) == whole["choices"][0]["text"]
    # without include_usage: token chunks, then [DONE]
    with open_stream(port, body) as resp:
        data = events(resp)
    assert len(data) == 8 and data[-1] == "[DONE]"
    assert json.loads(data[-2])["choices"][0]["finish_reason"] == "length"


def test_a_chat_streams_the_role_then_one_delta_per_token(lab_server) -> None:  # noqa: F811
    _, port = lab_server(extra_args=[f"--served-model-name={MODEL}"])
    wait_for(lambda: health(port) == 200, 30, "/health 200")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with open_stream(port, body, "/v1/chat/completions") as resp:
        data = events(resp)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 4
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(len(d["content"]) == 1 and set(d) == {"content"} for d in deltas[1:])
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]


def test_requests_beyond_max_num_seqs_wait_and_metrics_count_them(lab_server) -> None:  # noqa: F811
    delay = 0.2
    _, port = lab_server(
        extra_args=[f"--served-model-name={MODEL}", "--max-num-seqs=1"],
        extra_env={"SPARKPLE_LAB_TOKEN_DELAY_S": str(delay)},
    )
    wait_for(lambda: health(port) == 200, 30, "/health 200")
    assert gauges(port) == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0}
    body = {"model": MODEL, "prompt": "slow", "max_tokens": 10}
    arrivals: dict[int, list[float]] = {0: [], 1: []}

    def client(n: int) -> None:
        with open_stream(port, body) as resp:
            for raw in resp:
                if raw.startswith(b"data: "):
                    arrivals[n].append(time.monotonic())

    threads = [threading.Thread(target=client, args=(n,)) for n in (0, 1)]
    threads[0].start()
    wait_for(lambda: len(arrivals[0]) >= 1, 10, "the first stream's first chunk")
    threads[1].start()
    # one runs, the other waits for the one slot
    wait_for(
        lambda: gauges(port) == {"vllm:num_requests_running": 1, "vllm:num_requests_waiting": 1},
        10,
        "one running and one waiting request",
    )
    for t in threads:
        t.join(30)
    assert [len(arrivals[n]) for n in (0, 1)] == [11, 11]  # 10 tokens and [DONE] each
    # the second ran only after the first had finished
    assert arrivals[1][0] >= arrivals[0][-1]
    # each token took at least the delay: the stream lasted, it was not sent in one piece
    assert arrivals[0][-2] - arrivals[0][0] >= 9 * delay * 0.9
    assert gauges(port) == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0}


def test_an_engine_that_stops_mid_stream_ends_it_with_an_error_chunk(lab_server) -> None:  # noqa: F811
    front, port = lab_server(
        extra_args=[f"--served-model-name={MODEL}"],
        extra_env={"SPARKPLE_LAB_TOKEN_DELAY_S": "0.2"},
    )
    wait_for(lambda: health(port) == 200, 30, "/health 200")
    engine = engine_of(front)
    with open_stream(port, {"model": MODEL, "prompt": "x", "max_tokens": 50}) as resp:
        first = resp.readline()
        assert first.startswith(b"data: {")
        os.kill(engine, signal.SIGSTOP)
        try:
            rest = events(resp)
        finally:
            os.kill(engine, signal.SIGCONT)
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["code"] == 504 and "did not answer" in error["message"]
    assert len(rest) < 50  # truncated, and said so
    wait_for(lambda: gauges(port)["vllm:num_requests_running"] == 0, 10, "the request ended")
