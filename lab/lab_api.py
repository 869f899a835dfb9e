"""The lab server's OpenAI API (see lab_server.py): the front's state and the HTTP handler for
/health, /metrics, /v1/models, /v1/completions and /v1/chat/completions, the requests it hands
to the engine over its unix socket, and each reply in vLLM's shapes, a JSON body or server-sent
events. It is NOT vLLM.

A chat request that forces a tool call (`tool_choice: "required"`, or a named function) is
answered as vLLM answers it (unstreamed only): vLLM constrains the output to the tools' JSON
schema (tool_parsers/utils.py, get_json_schema_from_tools), so the lab fills the schema from
the engine's tokens for the request (the chat's text and the tools): which tool ("required"),
each enum's member, each number and each string come from them, so the call always parses and a
table with other rows makes another call. Its message is vLLM's: content "", one tool call with
a `chatcmpl-tool-` id, finish reason "tool_calls" ("length" with the arguments cut where
max_tokens is under the call's TOOL_CALL_TOKENS).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

from lab_engine import log
from lab_metrics import ServingMetrics

# vLLM's default --max-num-seqs (the requests the scheduler runs at once).
DEFAULT_MAX_NUM_SEQS = 256
# The engine's tokens a forced tool call takes (the lab's call is short; its values cycle them).
TOOL_CALL_TOKENS = 8


def send_json(handler: BaseHTTPRequestHandler, code: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class EngineConnection(http.client.HTTPConnection):
    """HTTP to the engine over its unix socket; every send and receive is bounded by timeout."""

    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("lab-engine", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class State:
    ready: bool = False
    problem: str = "starting: the engine is opening the table"
    model: str = ""
    patches: str = ""
    socket_path: str = ""
    model_root: str = ""
    max_model_len: int = 0
    started: int = int(time.time())
    engine_timeout_s: float = 30.0
    stopping: bool = False
    exit_code: int = 0
    # one thread at a time reaps the engine: two waitpid()s race, and one sees it still alive
    reap_lock = threading.Lock()

    def __init__(self, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> None:
        # the scheduler's slots: a request runs while it holds one and waits for one before
        self.slots = threading.BoundedSemaphore(max_num_seqs)
        self.counts_lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        # tokens, finished requests and time to first token (the model name is set in main)
        self.metrics = ServingMetrics("")

    def count(self, running: int = 0, waiting: int = 0) -> None:
        with self.counts_lock:
            self.running += running
            self.waiting += waiting


class EngineError(Exception):
    """The engine failed a request: (HTTP status, message)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def engine_steps(state: State, prompt: str, max_tokens: int) -> Iterator[dict[str, Any]]:
    """The engine's lines for one request: {"token", "text"} each, then {"done", ...}.

    Raises EngineError: 504 when the engine sends nothing within the engine timeout, 503 when it
    cannot be reached, 500 when it reports a failure."""
    conn = EngineConnection(state.socket_path, state.engine_timeout_s)
    try:
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens})
        conn.request("POST", "/complete", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        while True:
            raw = reply.readline()
            if not raw:
                raise EngineError(500, "the engine closed the stream before it finished")
            line = json.loads(raw)
            if "error" in line:
                raise EngineError(500, line["error"])
            yield line
            if line.get("done"):
                return
    except TimeoutError:
        raise EngineError(
            504, f"the engine did not answer within {state.engine_timeout_s} s"
        ) from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise EngineError(503, f"the engine is unreachable: {type(exc).__name__}: {exc}") from None
    finally:
        conn.close()


def metrics_text(state: State) -> str:
    """vLLM's series under its names and labels (vllm/v1/metrics/loggers.py; lab_metrics)."""
    with state.counts_lock:
        running, waiting = state.running, state.waiting
    return state.metrics.render(running, waiting)


def openai_error(handler: BaseHTTPRequestHandler, code: int, message: str, kind: str) -> None:
    """An error in the shape vLLM's OpenAI server sends."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    send_json(handler, code, body)


def chat_prompt(messages: Any) -> str:
    """The text of a chat's messages (a stand-in for the chat template)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    parts = []
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError("each message needs a role")
        content = message.get("content") or ""
        if isinstance(content, list):  # content parts: keep the text ones
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"{message['role']}: {content}")
    return "\n".join(parts)


def forced_tool(req: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools a chat request's tool_choice forces a call among (all of them for "required",
    the named one), None where it forces none; ValueError as vLLM refuses the request."""
    choice, tools = req.get("tool_choice"), req.get("tools")
    if choice in (None, "none", "auto"):
        return None
    if not isinstance(tools, list) or not tools:
        raise ValueError("When using `tool_choice`, `tools` must be set.")
    functions = [t for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    if len(functions) != len(tools) or any("name" not in t["function"] for t in functions):
        raise ValueError("each tool must be a function with a name")
    if choice == "required":
        return functions
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        named = [t for t in functions if t["function"]["name"] == name]
        if not named:
            raise ValueError(f"Tool '{name}' has not been passed in `tools`.")
        return named
    raise ValueError(f"unsupported tool_choice {json.dumps(choice)}")


def fill(schema: Any, take: Callable[[], int]) -> Any:
    """A value valid against `schema` (the subset tool parameters use), each choice made by the
    next of the engine's tokens."""
    schema = schema if isinstance(schema, dict) else {}
    kind = schema.get("type")
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][take() % len(schema["enum"])]
    if kind == "object" or "properties" in schema:
        return {name: fill(sub, take) for name, sub in schema.get("properties", {}).items()}
    if kind in ("integer", "number"):
        low = int(schema.get("minimum", 0))
        high = int(schema.get("maximum", low + 100))
        return low + take() % (high - low + 1)
    if kind == "boolean":
        return take() % 2 == 1
    if kind == "array":
        return [fill(schema.get("items", {}), take)]
    if kind == "null":
        return None
    size = min(max(int(schema.get("minLength", 1)), 6), int(schema.get("maxLength", 6)))
    return "".join(chr(ord("a") + take() % 26) for _ in range(size))


class Reply:
    """One completion's answer in vLLM's shapes: a JSON body, or server-sent events."""

    def __init__(
        self,
        handler: BaseHTTPRequestHandler,
        state: State,
        chat: bool,
        stream: bool,
        include_usage: bool,
    ) -> None:
        self.handler, self.state, self.chat = handler, state, chat
        self.stream, self.include_usage = stream, include_usage
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-lab-{time.time_ns()}"
        self.created = int(time.time())
        self.arrived = time.monotonic()  # vLLM's time to first token includes the queue

    def envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.state.model,
            "choices": choices,
        }

    def event(self, body: dict[str, Any] | str) -> None:
        data = body if isinstance(body, str) else json.dumps(body)
        self.handler.wfile.write(f"data: {data}\n\n".encode())
        self.handler.wfile.flush()

    def chunk(self, text: str | None, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None}
            kind = "text_completion"
        choice.update(finish_reason=finish_reason, stop_reason=None)
        return self.envelope(kind, [choice])

    def send(self, prompt: str, max_tokens: int) -> None:
        steps = engine_steps(self.state, prompt, max_tokens)
        texts: list[str] = []
        try:
            # the first token (or the engine's failure) before any header: an engine that is
            # down or wedged is an HTTP error, as a request vLLM cannot start
            first = next(steps)
        except EngineError as exc:
            send_json(self.handler, exc.code, {"error": str(exc)})
            return
        self.state.metrics.observe_ttft(time.monotonic() - self.arrived)
        if self.stream:
            self.handler.send_response(200)
            self.handler.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.handler.send_header("Cache-Control", "no-cache")
            self.handler.end_headers()  # HTTP/1.0: the stream ends when the connection closes
            if self.chat:
                self.event(self.chunk(None, None))  # vLLM's first chat chunk: the role
        line = first
        try:
            while not line.get("done"):
                texts.append(line["text"])
                if self.stream:  # the last token's chunk carries the finish reason
                    last = len(texts) == max_tokens  # the lab has no EOS: always max_tokens
                    self.event(self.chunk(line["text"], "length" if last else None))
                line = next(steps)
        except EngineError as exc:
            if not self.stream:
                send_json(self.handler, exc.code, {"error": str(exc)})
                return
            error = {"message": str(exc), "type": "InternalServerError", "code": exc.code}
            self.event({"error": error})
            self.event("[DONE]")
            return
        prompt_tokens = max(1, len(prompt.encode("utf-8")))
        self.state.metrics.count_finished(prompt_tokens, line["tokens"], "length")
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": line["tokens"],
            "total_tokens": prompt_tokens + line["tokens"],
        }
        if self.stream:
            if self.include_usage:
                kind = "chat.completion.chunk" if self.chat else "text_completion"
                self.event({**self.envelope(kind, []), "usage": usage})
            self.event("[DONE]")
            return
        text = "".join(texts)
        if self.chat:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text,
                "reasoning_content": None,
                "tool_calls": [],
            }
            choice = {"index": 0, "message": message, "logprobs": None}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
            kind = "text_completion"
        choice["finish_reason"] = "length"
        lab = {
            "stand_in": "sparkple lab server, not vLLM",
            "ple_rows_gathered": line["rows_gathered"],
            "table": line["table"],
        }
        body = {**self.envelope(kind, [choice]), "usage": usage, "sparkple_lab": lab}
        send_json(self.handler, 200, body)

    def send_tool_call(self, prompt: str, tools: list[dict[str, Any]], max_tokens: int) -> None:
        """A forced tool call, unstreamed: the engine's tokens for the chat's text and tools
        choose the tool and fill its parameters' schema (vLLM's structured output)."""
        schemas = json.dumps([t["function"] for t in tools], sort_keys=True)
        count = min(max_tokens, TOOL_CALL_TOKENS)
        tokens: list[int] = []
        try:
            for line in engine_steps(self.state, f"{prompt}\ntools: {schemas}", count):
                if line.get("done"):
                    break
                tokens.append(int(line["token"]))
        except EngineError as exc:
            send_json(self.handler, exc.code, {"error": str(exc)})
            return
        self.state.metrics.observe_ttft(time.monotonic() - self.arrived)
        turn = iter(range(1 << 30))

        def take() -> int:
            return tokens[next(turn) % len(tokens)]

        tool = tools[take() % len(tools)]["function"]
        arguments = json.dumps(fill(tool.get("parameters", {}), take))
        finish = "tool_calls"
        if count < TOOL_CALL_TOKENS:  # cut by max_tokens, as a real call would be
            arguments, finish = arguments[: len(arguments) * count // TOOL_CALL_TOKENS], "length"
        prompt_tokens = max(1, len(prompt.encode("utf-8")))
        # the engine's reason (vLLM's metrics): the call ended (stop) or was cut (length)
        reason = "length" if finish == "length" else "stop"
        self.state.metrics.count_finished(prompt_tokens, len(tokens), reason)
        call = {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                "function": {"name": tool["name"], "arguments": arguments}}  # fmt: skip
        message = {"role": "assistant", "content": "", "reasoning_content": None,
                   "tool_calls": [call]}  # fmt: skip
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens),
                 "total_tokens": prompt_tokens + len(tokens)}  # fmt: skip
        lab = {"stand_in": "sparkple lab server, not vLLM"}
        body = {**self.envelope("chat.completion", [choice]), "usage": usage, "sparkple_lab": lab}
        send_json(self.handler, 200, body)


def make_handler(state: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:
            sys.stderr.write("lab_server: " + (fmt % args) + "\n")

        def _authorized(self) -> bool:
            key = os.environ.get("VLLM_API_KEY", "")
            if key and self.headers.get("Authorization", "") != f"Bearer {key}":
                send_json(self, 401, {"error": "Unauthorized"})
                return False
            return True

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/health":
                failing = os.environ.get("SPARKPLE_LAB_HEALTH_FAIL_FILE", "")
                if failing and os.path.exists(failing):
                    send_json(self, 503, {"error": f"the engine core is dead ({failing} exists)"})
                elif state.ready:
                    send_json(self, 200, {"status": "ok", "patches": state.patches})
                else:
                    send_json(self, 503, {"error": state.problem})
            elif self.path == "/metrics":  # like vLLM's, not behind the API key
                data = metrics_text(state).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            elif self.path == "/v1/models":
                if self._authorized():
                    card = {
                        "id": state.model,
                        "object": "model",
                        "created": state.started,
                        "owned_by": "vllm",
                        "root": state.model_root,
                        "parent": None,
                        "max_model_len": state.max_model_len or None,
                    }
                    send_json(self, 200, {"object": "list", "data": [card]})
            else:
                send_json(self, 404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            chat = self.path == "/v1/chat/completions"
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                send_json(self, 404, {"error": f"no route {self.path}"})
                return
            if not self._authorized():
                return
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                if not isinstance(req, dict):
                    raise ValueError("the body must be a JSON object")
                prompt = chat_prompt(req.get("messages")) if chat else str(req.get("prompt", ""))
                tools = forced_tool(req) if chat else None
                if tools is not None and req.get("stream") is True:
                    raise ValueError("the lab server answers a forced tool call unstreamed only")
                limit = req.get("max_completion_tokens") if chat else None
                max_tokens = int(limit if limit is not None else req.get("max_tokens", 16))
            except (ValueError, TypeError) as exc:
                openai_error(self, 400, f"bad request body: {exc}", "BadRequestError")
                return
            model = req.get("model")
            if model is not None and model != state.model:
                openai_error(self, 404, f"The model `{model}` does not exist.", "NotFoundError")
                return
            if not 1 <= max_tokens <= 256:
                openai_error(self, 400, "max_tokens must be in 1..256", "BadRequestError")
                return
            if not state.ready:
                send_json(self, 503, {"error": state.problem})
                return
            stream = req.get("stream") is True
            options = req.get("stream_options") or {}
            reply = Reply(self, state, chat, stream, bool(options.get("include_usage")))
            state.count(waiting=1)
            state.slots.acquire()
            state.count(waiting=-1, running=1)
            try:
                if tools is not None:
                    reply.send_tool_call(prompt, tools, max_tokens)
                else:
                    reply.send(prompt, max_tokens)
            except (BrokenPipeError, ConnectionResetError):
                log(f"the client of {reply.id} went away")
            finally:
                state.count(running=-1)
                state.slots.release()

    return Handler
