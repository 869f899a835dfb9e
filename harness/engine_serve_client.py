"""A streaming chat completion and a completion from a `vllm serve`, through the `openai`
client, both in flight at once; run in the vLLM test venv (the client is a vLLM dependency) by
harness/engine_serve.run_client.

    python engine_serve_client.py BASE_URL SPEC_JSON RESULT_JSON

The spec: {"model", "chat": {"messages", "max_tokens"}, "completion": {"prompt" (token ids),
"max_tokens"}}. Both are greedy and ignore EOS; both ask vLLM for the token ids
(`return_token_ids`), the completion also for its tokens as ids in its logprobs.

The result: {"models" (the served names), "chat": {"role", "content", "reasoning", "token_ids",
"prompt_token_ids", "chunks", "finish_reason", "usage", "first_chunk_s", "total_s"},
"completion": {"token_ids", "logprob_tokens", "text", "prompt_token_ids", "finish_reason",
"usage", "total_s"}}.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# the vLLM venv's client; the tools venv (where mypy runs) has none
OpenAI = importlib.import_module("openai").OpenAI

# vLLM's own request fields (beside OpenAI's), sent as extra body
GREEDY = {"ignore_eos": True, "return_token_ids": True}


def extra(obj: Any, name: str) -> Any:
    """A field vLLM adds beside OpenAI's (the client keeps it in model_extra)."""
    return (getattr(obj, "model_extra", None) or {}).get(name)


def stream_chat(client: Any, model: str, spec: dict[str, Any]) -> dict[str, Any]:
    started = time.monotonic()
    first = None
    out: dict[str, Any] = {"role": None, "content": "", "reasoning": "", "token_ids": []}
    out.update(prompt_token_ids=None, chunks=0, finish_reason=None, usage=None)
    stream = client.chat.completions.create(
        model=model,
        messages=spec["messages"],
        max_tokens=int(spec["max_tokens"]),
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=GREEDY,
    )
    for chunk in stream:
        first = first if first is not None else time.monotonic() - started
        out["chunks"] += 1
        out["prompt_token_ids"] = out["prompt_token_ids"] or extra(chunk, "prompt_token_ids")
        if chunk.usage is not None:
            out["usage"] = chunk.usage.model_dump()
        for choice in chunk.choices:
            delta = choice.delta
            out["role"] = out["role"] or delta.role
            out["content"] += delta.content or ""
            # the reasoning parser's part (the recipe's qwen3): text before a </think>
            out["reasoning"] += extra(delta, "reasoning") or ""
            out["token_ids"] += list(extra(choice, "token_ids") or [])
            out["finish_reason"] = choice.finish_reason or out["finish_reason"]
    out.update(first_chunk_s=first, total_s=time.monotonic() - started)
    return out


def complete(client: Any, model: str, spec: dict[str, Any]) -> dict[str, Any]:
    started = time.monotonic()
    response = client.completions.create(
        model=model,
        prompt=list(spec["prompt"]),
        max_tokens=int(spec["max_tokens"]),
        temperature=0.0,
        logprobs=1,
        extra_body={**GREEDY, "return_tokens_as_token_ids": True},
    )
    (choice,) = response.choices
    tokens = choice.logprobs.tokens if choice.logprobs else []
    return {
        "token_ids": list(extra(choice, "token_ids") or []),
        # "token_id:N" per generated token (return_tokens_as_token_ids)
        "logprob_tokens": list(tokens or []),
        "text": choice.text,
        "prompt_token_ids": extra(choice, "prompt_token_ids"),
        "finish_reason": choice.finish_reason,
        "usage": response.usage.model_dump() if response.usage else None,
        "total_s": time.monotonic() - started,
    }


def main() -> int:
    url, spec_path, result_path = sys.argv[1:4]
    spec = json.loads(Path(spec_path).read_text())
    client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600, max_retries=0)
    model = spec["model"]
    models = [m.id for m in client.models.list()]
    with ThreadPoolExecutor(2) as pool:
        chat = pool.submit(stream_chat, client, model, spec["chat"])
        completion = pool.submit(complete, client, model, spec["completion"])
        result = {"models": models, "chat": chat.result(), "completion": completion.result()}
    Path(result_path).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
