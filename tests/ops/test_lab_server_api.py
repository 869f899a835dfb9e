"""The lab server's command line and OpenAI routes: it refuses what vLLM would refuse (unknown
flags, mangled JSON), and answers /v1/models and /v1/chat/completions in vLLM's shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ops_helpers import LAB, ROOT, wait_for
from test_lab_server import health, lab_server, request  # noqa: F401 - fixtures

MTP = '--speculative-config={"method":"mtp","num_speculative_tokens":3}'


def refused(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(LAB / "lab_server.py"), "/nonexistent", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=30)


def test_unknown_flags_are_refused_like_vllm() -> None:
    proc = refused("--max-num-sequences=4")
    assert proc.returncode == 2 and "unrecognized arguments: --max-num-sequences=4" in proc.stderr
    # a lab-only flag is no exception: the unit carries vLLM's flags only
    assert refused("--engine-timeout-s=3").returncode == 2


def test_json_flags_must_arrive_as_json() -> None:
    mangled = MTP.replace('"', "")  # what systemd leaves of unquoted double quotes
    proc = refused(mangled)
    assert proc.returncode == 2 and "--speculative-config" in proc.stderr
    assert "not JSON" in proc.stderr


def test_chat_and_models_in_vllms_shape(lab_server, lab_data) -> None:  # noqa: F811
    env_args = ["--served-model-name=qwen3.8-flash-next", MTP, "--max-model-len=262144"]
    front, port = lab_server(extra_args=env_args)
    wait_for(lambda: health(port) == 200, 30, "/health 200")  # the engine ready for the chat
    code, models = request(port, "/v1/models")
    assert code == 200
    (card,) = models["data"]
    assert card["id"] == "qwen3.8-flash-next" and card["object"] == "model"
    assert card["max_model_len"] == 262_144
    body = {
        "model": "qwen3.8-flash-next",
        "messages": [{"role": "user", "content": "hello spark"}],
        "max_completion_tokens": 6,
    }
    code, chat = request(port, "/v1/chat/completions", body)
    assert code == 200, chat
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    (choice,) = chat["choices"]
    assert choice["message"]["role"] == "assistant" and len(choice["message"]["content"]) == 6
    assert chat["usage"]["completion_tokens"] == 6
    assert chat["sparkple_lab"]["ple_rows_gathered"] >= 6 * lab_data["heads"]
    # another model name is vLLM's 404
    code, err = request(port, "/v1/chat/completions", {**body, "model": "gpt-x"})
    assert code == 404 and err["error"]["message"] == "The model `gpt-x` does not exist."
    code, err = request(port, "/v1/chat/completions", {**body, "messages": []})
    assert code == 400 and "messages" in json.dumps(err)
