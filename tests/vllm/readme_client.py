"""The README's client examples, as written, against a lab's API on this machine's loopback.

Run by molecule/default's verify with SPARKPLE_LAB_API_URL naming where the lab container's API
is published (`make lab` publishes it at the README's own http://127.0.0.1:8000; the scenario at
another port, which is the one word changed). Not a test_*.py file: a plain pytest run has no lab
to talk to, and a skip would hide that under CI.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_URL = "http://127.0.0.1:8000"
LAB_URL = os.environ.get("SPARKPLE_LAB_API_URL", "")


def readme_block(language: str, marker: str) -> str:
    """The README's first ```language block that contains `marker`, pointed at the lab."""
    blocks = re.findall(rf"```{language}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    block = next(b for b in blocks if marker in b)
    assert README_URL in block, f"the README's {language} example no longer names {README_URL}"
    return block.replace(README_URL, LAB_URL)


def test_the_readmes_curl_example_answers() -> None:
    assert LAB_URL, "SPARKPLE_LAB_API_URL must name the lab's published API"
    # the console block: `$ ` starts the command, a trailing backslash continues it
    command = readme_block("console", "curl ").removeprefix("$ ")
    env = {k: v for k, v in os.environ.items() if k != "SPARKPLE_API_KEY"}
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    reply = json.loads(proc.stdout)
    assert reply["object"] == "chat.completion" and reply["model"] == "qwen3.8-flash-next"
    message = reply["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"], reply
    print(f"curl example: {reply['usage']['completion_tokens']} tokens: {message['content']!r}")


def test_the_readmes_openai_example_streams(vllm_venv: Path) -> None:
    """The openai client of vLLM's own requirements (the vLLM test venv), streaming: every
    chunk the example prints is counted, so a reply that came in one piece fails."""
    assert LAB_URL, "SPARKPLE_LAB_API_URL must name the lab's published API"
    example = readme_block("python", "from openai import OpenAI")
    counted = (
        "import builtins\n"
        "printed = []\n"
        "def print(*args, **kwargs):\n"
        "    printed.append(args)\n"
        "    builtins.print(*args, **kwargs)\n"
        f"{example}\n"
        "import sys\n"
        "sys.stderr.write(f'chunks printed: {len(printed)}\\n')\n"
    )
    proc = subprocess.run([str(vllm_venv), "-c", counted], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    counted_line = re.search(r"chunks printed: (\d+)", proc.stderr)
    assert counted_line is not None, proc.stderr[-3000:]
    chunks = int(counted_line.group(1))
    assert chunks >= 2 and proc.stdout.strip(), (chunks, proc.stdout)
    print(f"openai example: {chunks} chunks streamed: {proc.stdout!r}")
