"""At start, with vLLM 0.34.0's own loader code: the table checked against the checkpoint,
the load settings that would read the row shards refused, and the row-shard bytes read."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from sparkple import patch
from sparkple.builder.build import build_table
from sparkple.builder.synth import synth_checkpoint

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "load_checks.py"
MIB = 1024**2


@pytest.fixture(scope="module")
def checks(vllm_venv: Path, vllm_originals: Path, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("load-checks")

    def snapshot(name: str, **kwargs) -> Path:
        # row shards (86 MiB) well beyond the kernel's readahead around the other tensors
        return synth_checkpoint(work / name, quant="nvfp4", vocab_base=60_000, files=2, **kwargs)

    served = snapshot("served", seed=1)
    table = work / "table"
    build_table(served, table, quiet=True)
    # the same geometry, other rows (another global scale), and another hash
    other_rows, other_hash = snapshot("other-rows", seed=2), snapshot("other-hash", hash_seed=99)
    rendered = work / "rendered"
    patch.render(patch.DEFAULT_PROFILE, vllm_originals, rendered)
    result_path = work / "result.json"
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{SCRIPT.parent}"}
    env.pop("SPARKPLE_PLE_TABLE_DIR", None)
    env.pop("SPARKPLE_STATS_DIR", None)
    cases = [f"{s}={table}" for s in (served, other_rows, other_hash)]
    args = [str(vllm_venv), str(SCRIPT), "cpu", str(rendered), str(result_path), *cases]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=work)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(result_path.read_text())
    result["table"] = str(table)
    return result


def test_the_table_is_checked_against_the_checkpoint_at_load(checks: dict) -> None:
    served, other_rows, other_hash = checks["at_load"]
    assert served == {"stopped_at": None, "checked_at_load": True}
    for case, differs in ((other_rows, "global scale"), (other_hash, "hash multipliers")):
        # vLLM's process_weights_after_loading raises: before profiling, warm-up, capture
        assert case["stopped_at"] == "load"
        message = case["error"]
        assert differs in message
        assert f"the packed PLE table {checks['table']} (built from snapshot " in message
        assert "does not match the checkpoint" in message
        assert "`sparkple build-table --force`" in message


def test_load_settings_that_read_row_shards_are_refused_by_flag(checks: dict) -> None:
    refused = checks["refusals"]
    assert refused["safetensors lazy"] is None and refused["auto lazy"] is None
    flags = {
        "eager": "--safetensors-load-strategy eager",
        "prefetch": "--safetensors-load-strategy prefetch",
        "unset strategy": "--safetensors-load-strategy (unset)",
        "multithread": "enable_multithread_load=true",
        "fastsafetensors": "--load-format fastsafetensors",
        "instanttensor": "--load-format instanttensor",
        "pt": "--load-format pt",
        "dummy": "--load-format dummy",
    }
    for setting, flag in flags.items():
        assert refused[setting] is not None, setting
        assert flag in refused[setting], refused[setting]
        assert "SPARKPLE_PLE_TABLE_DIR" in refused[setting]


def test_row_shard_bytes_read_per_strategy(checks: dict) -> None:
    """lazy, the one strategy allowed, reads no row-shard byte: none is handed out, no
    row-shard page beyond the kernel's readahead around the header and the other tensors is
    cached, and its read() calls are only the headers. eager and prefetch (refused) read every
    file whole."""
    lazy, eager, prefetch = (checks["bytes"][s] for s in ("lazy", "eager", "prefetch"))
    assert lazy["beyond_readahead_bytes"] > 8 * MIB
    assert lazy["handed_out_bytes"] == 0
    assert lazy["cached_beyond_bytes"] == 0
    assert lazy["cached_bytes"] < lazy["row_shard_bytes"]
    # lazy maps the files: its read() calls are the headers, far below the row shards
    assert lazy["read_call_bytes"] < lazy["row_shard_bytes"] // 8
    for read_all in (eager, prefetch):
        assert read_all["handed_out_bytes"] == 0  # the names are still filtered
        # whole files through read() (the kernel's count, not what the page cache keeps: a
        # loaded machine may evict some of those pages before they are counted)
        assert read_all["read_call_bytes"] >= read_all["file_bytes"]
        assert read_all["file_bytes"] > read_all["row_shard_bytes"] > 8 * MIB
