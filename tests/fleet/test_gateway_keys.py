"""The gateway's keys through a real HAProxy (Debian's, as the gateway role installs it) with the
role's own haproxy.cfg, rendered by Ansible, in front of two real lab servers that check their
own key (VLLM_API_KEY, as vLLM does): a client without the gateway's key gets HAProxy's 401, one
with it is answered (the gateway sent the Sparks' key in its place: a Spark refuses the client's),
and a request straight to a Spark behind the keyed gateway is refused there."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from ansible_local import run_playbook
from lab_inputs import free_port, lab_server

from sparkple.builder.build import build_table
from sparkple.builder.synth import synth_checkpoint

ROOT = Path(__file__).resolve().parents[2]
MODEL = "qwen3.8-flash-next"
CLIENT_KEY, SPARK_KEY = "client-key-of-the-gateway", "spark-key-from-the-vault"
PLAY = f"""
- hosts: localhost
  gather_facts: false
  vars_files: [{ROOT}/roles/gateway/defaults/main.yml]
  tasks:
    - ansible.builtin.template:
        src: {ROOT}/roles/gateway/templates/haproxy.cfg.j2
        dest: "{{{{ out }}}}"
        mode: "0644"
"""


def request(port: int, key: str | None) -> tuple[int, str]:
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2}).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body, headers=headers
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as answer:
            return answer.status, answer.headers.get("X-Sparkple-Server", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("X-Sparkple-Server", "")
    except urllib.error.URLError:
        return 0, ""  # nothing listening (yet)


@contextlib.contextmanager
def haproxy(tmp_path: Path, sparks: dict[str, int]) -> Iterator[int]:
    """The role's haproxy.cfg for these Sparks (host -> port on 127.0.0.1), plain HTTP on a free
    loopback port, its admin socket under tmp_path; HAProxy in the foreground, stopped after."""
    port = free_port()
    inventory = {
        "all": {"hosts": {"localhost": {"ansible_connection": "local", "sparkple_api_port": 8000}}},
        "sparks": {"hosts": {h: {"gateway_server_address": "127.0.0.1", "sparkple_api_port": p}
                             for h, p in sparks.items()}},
    }  # fmt: skip
    variables = {
        "out": str(tmp_path / "haproxy.cfg"),
        "gateway_bind_address": "127.0.0.1",
        "gateway_port": port,
        "gateway_tls": False,
        "gateway_admin_socket": str(tmp_path / "admin.sock"),
        "gateway_api_keys": [CLIENT_KEY],
        "gateway_backend_api_key": SPARK_KEY,
        "gateway_check_interval_s": 1,
    }
    done = run_playbook(tmp_path, PLAY, variables, inventory=inventory, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    config = tmp_path / "haproxy.cfg"
    check = subprocess.run(["haproxy", "-c", "-f", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    with open(tmp_path / "haproxy.log", "wb") as log:
        proxy = subprocess.Popen(["haproxy", "-db", "-f", str(config)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        # up once every Spark passed its health checks (rise 2 at 1 s)
        while request(port, CLIENT_KEY)[0] != 200:
            assert proxy.poll() is None, (tmp_path / "haproxy.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "haproxy.log").read_text()
            time.sleep(0.2)
        yield port
    finally:
        proxy.terminate()
        proxy.wait(15)


@pytest.fixture(scope="module")
def keyed_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, dict[str, int]]]:
    if shutil.which("haproxy") is None:
        pytest.fail("haproxy is not installed: .ci/setup-system installs it (apt)")
    root = tmp_path_factory.mktemp("keyed-gateway")
    snap = synth_checkpoint(root / "snap", vocab_base=2048, files=1, seed=5)
    build_table(snap, root / "table", quiet=True)
    args = [f"--served-model-name={MODEL}", "--max-num-seqs=4"]
    env = {"VLLM_API_KEY": SPARK_KEY}
    with contextlib.ExitStack() as stack:
        sparks = {}
        for name in ("spark-1", "spark-2"):
            (root / name).mkdir()
            sparks[name] = stack.enter_context(
                lab_server(root / name, snap, root / "table", args, env)
            )
        yield stack.enter_context(haproxy(root, sparks)), sparks


def test_a_client_without_the_gateways_key_gets_its_401(keyed_fleet) -> None:
    port, _ = keyed_fleet
    assert request(port, None) == (401, "")
    assert request(port, "a-guess") == (401, "")
    # the Sparks' own key is not a client key of the gateway either
    assert request(port, SPARK_KEY) == (401, "")


def test_the_gateway_sends_the_sparks_key_in_place_of_the_clients(keyed_fleet) -> None:
    port, sparks = keyed_fleet
    served = {request(port, CLIENT_KEY) for _ in range(6)}
    # answered, by a Spark that checks its own key: the client's never reached it
    assert {status for status, _ in served} == {200}
    assert {server for _, server in served} <= set(sparks)


def test_a_spark_behind_the_keyed_gateway_refuses_a_request_straight_to_it(keyed_fleet) -> None:
    _, sparks = keyed_fleet
    for port in sparks.values():
        assert request(port, None)[0] == 401
        assert request(port, CLIENT_KEY)[0] == 401
        assert request(port, SPARK_KEY)[0] == 200
