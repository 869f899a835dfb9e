"""The command lines a lab pair's two servers really run, through vLLM 0.34.0's parser.

Run by molecule/fleet's verify (verify_pair.yml) with SPARKPLE_LAB_PAIR_ARGS naming the
pair-args.json it wrote (each node's argv from /proc, after systemd): not a test_*.py file, so a
plain pytest run does not collect it (it would have nothing to check; a skip would hide that
under CI).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .test_serve_args import run_check

PAIR_ARGS = os.environ.get("SPARKPLE_LAB_PAIR_ARGS", "")
LAB_SERVER = "/opt/sparkple-lab/lab_server.py"


def words(argv: list[str]) -> list[str]:
    """What `vllm serve` would get: the words after the lab server's path."""
    assert LAB_SERVER in argv, argv
    return argv[argv.index(LAB_SERVER) + 1 :]


def flag(args: list[str], name: str) -> str | None:
    for arg in args:
        if arg == name:
            return ""
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def test_lab_pair_args(vllm_venv: Path, tmp_path: Path) -> None:
    assert PAIR_ARGS, "SPARKPLE_LAB_PAIR_ARGS must name the pair-args.json molecule/fleet wrote"
    pair = json.loads(Path(PAIR_ARGS).read_text())
    # the model path is the hosts': vLLM reads the model's config from the controller's copy
    config_dir = pair["config_dir"]
    cases = {
        side: {"args": words(pair[side]), "config_dir": config_dir} for side in ("head", "worker")
    }
    results = run_check(vllm_venv, cases, tmp_path)["cases"]
    for side, result in results.items():
        assert result["unknown"] == [], f"vLLM 0.34.0 does not know {result['unknown']} ({side})"
        assert result["error"] is None, f"{side}: {result['error']}"
        assert result["values"]["distributed_executor_backend"] == "mp", side
    head, worker = cases["head"]["args"], cases["worker"]["args"]
    for args in (head, worker):
        assert flag(args, "--tensor-parallel-size") == "2" and flag(args, "--nnodes") == "2"
        assert flag(args, "--master-addr") == pair["head_address"]
    assert flag(head, "--master-port") == flag(worker, "--master-port")
    assert (flag(head, "--node-rank"), flag(worker, "--node-rank")) == ("0", "1")
    for side, rank in (("head", 0), ("worker", 1)):
        values = results[side]["values"]
        assert (values["tensor_parallel_size"], values["nnodes"]) == (2, 2), values
        assert (values["node_rank"], values["master_addr"]) == (rank, pair["head_address"])
        assert values["headless"] is (rank == 1), values
    assert flag(head, "--headless") is None and flag(worker, "--headless") == ""
    print(json.dumps({side: cases[side]["args"] for side in cases}))
