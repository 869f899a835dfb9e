"""The packed-table builder: exact bytes, atomic publish, refusals, crash safety, CLI."""

from __future__ import annotations

import json
import os
import pty
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hf_snapshot import hf_cache_snapshot

from sparkple.builder.build import build_table
from sparkple.builder.plan import plan_build
from sparkple.builder.synth import synth_checkpoint
from sparkple.builder.verify import verify_table
from sparkple.errors import TableError
from sparkple.geometry import PLEGeometry
from sparkple.runtime.tablemeta import META_NAME, read_meta

from .conftest import ROOT, cli, run_cli

EMB = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding"


def reference_table(snapshot: Path) -> bytes:
    """The expected packed file, assembled with the safetensors library (not our reader)."""
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    index = json.loads((snapshot / "model.safetensors.index.json").read_text())["weight_map"]
    geo = PLEGeometry.from_config(json.loads((snapshot / "config.json").read_text()))

    def load(name: str) -> np.ndarray:
        with safe_open(str(snapshot / index[name]), framework="pt") as f:
            return f.get_tensor(name).contiguous().view(torch.uint8).numpy()

    parts = []
    for i in range(geo.shards):
        codes = load(f"{EMB}.shard_{i}.weight")
        scale_name = f"{EMB}.shard_{i}.weight_scale"
        parts.append(
            np.concatenate([codes, load(scale_name)], axis=1) if scale_name in index else codes
        )
    return np.concatenate(parts).tobytes()


GEOMETRIES: dict[str, dict[str, Any]] = {
    "nvfp4-3files": dict(quant="nvfp4", vocab_base=1000, files=3),
    "fp8-5files": dict(quant="fp8", vocab_base=700, files=5),
    "nvfp4-short-last-shard": dict(
        quant="nvfp4", vocab_base=900, files=4, shards=7, divisible_by=64
    ),
    "fp8-one-file-odd-shards": dict(
        quant="fp8", vocab_base=400, files=1, shards=5, divisible_by=16
    ),
    "nvfp4-4gram": dict(
        quant="nvfp4", vocab_base=300, files=2, ngram_size=4, heads_per_ngram=2, head_dim=32
    ),
}


@pytest.mark.parametrize("name", GEOMETRIES, ids=list(GEOMETRIES))
def test_packed_file_equals_concatenated_shards(tmp_path, name):
    snap = synth_checkpoint(tmp_path / "snap", **GEOMETRIES[name])
    status, meta = build_table(snap, tmp_path / "table", chunk_mib=0.01, quiet=True)
    assert status == "built"
    data = meta.data_path(tmp_path / "table").read_bytes()
    assert data == reference_table(snap)
    geo = PLEGeometry.from_config(json.loads((snap / "config.json").read_text()))
    assert meta.total_rows == geo.total_rows and len(data) == geo.total_rows * meta.row_width
    assert read_meta(tmp_path / "table") == meta
    assert sorted(p.name for p in (tmp_path / "table").iterdir()) == sorted(
        [".build.lock", META_NAME, meta.data_file]
    )


def test_metadata_contents(snapshots, tmp_path):
    snap = snapshots("nvfp4", files=3)
    _, meta = build_table(snap, tmp_path / "t", quiet=True)
    assert meta.format_version == 1 and meta.quant == "nvfp4"
    assert meta.ple_prefix == EMB and meta.vllm_param == f"{EMB}.weight"
    assert (meta.row_width, meta.codes_width, meta.scales_width) == (90, 80, 10)
    assert (meta.codes_dtype, meta.scales_dtype) == ("U8", "F8_E4M3")
    assert meta.shards == 128 and meta.num_heads == 16 and meta.head_dim == 160
    assert meta.global_scale == plan_build(snap).global_scale
    names = {f["name"] for f in meta.source.files}
    assert names == {p.name for p in snap.glob("*.safetensors")}
    assert meta.source.snapshot_id == "snap" and len(meta.source.index_sha256) == 64


def test_up_to_date_rerun_is_a_noop(snapshots, tmp_path):
    snap = snapshots("nvfp4", files=3)
    assert cli("build-table", snap, tmp_path / "t").returncode == 0
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "t").iterdir()}
    res = cli("build-table", snap, tmp_path / "t")
    assert res.returncode == 0 and "up to date" in res.stdout
    assert before == {p.name: p.stat().st_mtime_ns for p in (tmp_path / "t").iterdir()}


def test_stale_table_is_refused_then_forced(snapshots, tmp_path):
    out = tmp_path / "t"
    build_table(snapshots("nvfp4", files=3), out, quiet=True)
    old = read_meta(out)
    other = snapshots("nvfp4-seed9", files=3, seed=9)
    res = cli("build-table", other, out)
    assert res.returncode == 1
    assert "--force" in res.stderr and "global_scale" in res.stderr
    assert read_meta(out) == old
    res = cli("build-table", other, out, "--force")
    assert res.returncode == 0, res.stderr
    new = read_meta(out)
    assert new.data_file != old.data_file and not (out / old.data_file).exists()
    assert new.data_path(out).read_bytes() == reference_table(other)


def test_a_new_revision_of_the_same_sizes_is_rebuilt_as_the_role_runs_it(tmp_path):
    """A re-quantized checkpoint: a new revision whose files have the same names and sizes (the
    stamp of names and sizes roles/ple_table once kept could not tell them apart). The builder's
    source fingerprint (the revision, the index's sha256) and global scale do: run as the role
    runs it (--force), the table is rebuilt from the new revision; run again, it is up to date;
    --rebuild (ple_table_force) builds anew even then."""
    old = hf_cache_snapshot(tmp_path / "a", files=2, seed=1, rev="rev-old")
    new = hf_cache_snapshot(tmp_path / "b", files=2, seed=2, rev="rev-new")

    def sizes(snapshot: Path) -> list[tuple[str, int]]:
        return sorted((p.name, p.stat().st_size) for p in snapshot.glob("*.safetensors*"))

    assert sizes(old) == sizes(new)
    out = tmp_path / "table"
    assert "build-table: published" in cli("build-table", old, out, "--force").stdout
    res = cli("build-table", new, out, "--force", "--quiet")
    assert res.returncode == 0 and "build-table: published" in res.stdout, res.stderr
    meta = read_meta(out)
    assert meta.source.snapshot_id == "rev-new"
    assert meta.data_path(out).read_bytes() == reference_table(new)
    again = cli("build-table", new, out, "--force", "--quiet")
    assert again.returncode == 0 and "is up to date" in again.stdout
    rebuilt = cli("build-table", new, out, "--force", "--quiet", "--rebuild")
    assert rebuilt.returncode == 0 and "build-table: published" in rebuilt.stdout
    assert read_meta(out).data_file != meta.data_file and not (out / meta.data_file).exists()


def test_builder_imports_only_stdlib_and_numpy(snapshots, tmp_path):
    code = (
        "import sys\n"
        "from sparkple.cli import main\n"
        "rc = main(['build-table', sys.argv[1], sys.argv[2], '--quiet'])\n"
        "heavy = [m for m in ('torch', 'jinja2', 'yaml', 'safetensors') if m in sys.modules]\n"
        "print(rc, heavy)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run(
        [sys.executable, "-c", code, str(snapshots("nvfp4", files=3)), str(tmp_path / "t")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert res.stdout.split("\n")[-2] == "0 []", res.stderr


def test_inspect_and_verify_cli(snapshots, tmp_path):
    snap, out = snapshots("nvfp4", files=3), tmp_path / "t"
    res = cli("inspect-table", out, "--json")
    assert res.returncode == 1 and json.loads(res.stdout)["healthy"] is False
    assert cli("build-table", snap, out).returncode == 0
    res = cli("inspect-table", out, "--json")
    info = json.loads(res.stdout)
    assert res.returncode == 0 and info["healthy"] is True
    assert Path(info["data_path"]).is_absolute() and Path(info["data_path"]).is_file()
    assert info["meta_path"] == str((out / META_NAME).resolve())
    assert info["total_rows"] * info["row_width"] == Path(info["data_path"]).stat().st_size
    text = cli("inspect-table", out)
    assert text.returncode == 0 and "nvfp4" in text.stdout
    assert f"fingerprint {info['fingerprint']}" in text.stdout
    # another build of the same snapshot (another node's copy): one fingerprint
    assert cli("build-table", snap, tmp_path / "t2").returncode == 0
    again = json.loads(cli("inspect-table", tmp_path / "t2", "--json").stdout)
    assert again["data_file"] != info["data_file"]
    assert again["fingerprint"] == info["fingerprint"] and len(info["fingerprint"]) == 64
    assert cli("verify-table", snap, out, "--full").returncode == 0
    assert cli("verify-table", snap, out, "--sample", "50").returncode == 0
    # flip one byte in the middle of the data file: a full verify finds it
    data = Path(info["data_path"])
    with open(data, "r+b") as f:
        f.seek(data.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    res = cli("verify-table", snap, out, "--full")
    assert res.returncode == 1 and "differ" in res.stderr
    # a data file of the wrong size is not a published table
    with open(data, "ab") as f:
        f.write(b"\0")
    assert cli("inspect-table", out, "--json").returncode == 1
    with pytest.raises(TableError, match="bytes"):
        read_meta(out)


def test_usage_errors_exit_2(tmp_path):
    assert cli("build-table", tmp_path / "nope", tmp_path / "t").returncode == 2
    assert cli("build-table").returncode == 2
    (tmp_path / "file").write_text("x")
    assert cli("build-table", tmp_path, tmp_path / "file").returncode == 2
    assert not (tmp_path / "t").exists()


def test_progress_plain_lines_and_tty_bar(snapshots, tmp_path):
    snap = snapshots("nvfp4", files=3)
    res = run_cli("build-table", snap, tmp_path / "a", "--chunk-mib", "0.05")
    lines = [ln for ln in res.stderr.splitlines() if "MiB/s" in ln]
    assert len(lines) >= 5 and "\r" not in res.stderr and lines[-1].count("(100%)") == 1
    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparkple.cli", "build-table", str(snap), str(tmp_path / "b")],
        stderr=slave,
        stdout=subprocess.DEVNULL,
        env=env,
    )
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    assert proc.wait() == 0
    os.close(master)
    assert b"\r" in out and b"[#" in out and b"100.0%" in out


# ------------------------------------------------------------------ bad inputs write nothing


def _edit_index(snap: Path, fn) -> None:
    path = snap / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    fn(index["weight_map"])
    path.write_text(json.dumps(index))


def _edit_config(snap: Path, fn) -> None:
    path = snap / "config.json"
    cfg = json.loads(path.read_text())
    fn(cfg["text_config"])
    path.write_text(json.dumps(cfg))


def _rewrite_header(snap: Path, tensor: str, **changes) -> None:
    """Change one tensor's header entry in place, keeping the header length."""
    index = json.loads((snap / "model.safetensors.index.json").read_text())["weight_map"]
    path = snap / index[tensor]
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header[tensor].update(changes)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    path.write_bytes(raw[:8] + new + b" " * (n - len(new)) + raw[8 + n :])


def _patch_bytes(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _first_file(snap: Path) -> Path:
    return sorted(snap.glob("*.safetensors"))[0]


def _file_of(snap: Path, tensor: str) -> Path:
    return (
        snap / json.loads((snap / "model.safetensors.index.json").read_text())["weight_map"][tensor]
    )


def _rebuild(path: Path, header_json: str, data: bytes) -> None:
    """Write a safetensors file from a raw JSON header text and its data section."""
    raw = header_json.encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _duplicate_key(snap: Path) -> None:
    """shard_5.weight named twice: the second entry points at junk appended after the data.

    A JSON reader that keeps the last entry would pack the junk as shard 5's rows.
    """
    name = f"{EMB}.shard_5.weight"
    path = _file_of(snap, name)
    header, data = _split(path)
    entry = header[name]
    size = entry["data_offsets"][1] - entry["data_offsets"][0]
    fake = dict(entry, data_offsets=[len(data), len(data) + size])
    text = json.dumps(header, separators=(",", ":"))
    text = text[:-1] + "," + json.dumps(name) + ":" + json.dumps(fake, separators=(",", ":")) + "}"
    _rebuild(path, text, data + bytes([0x77]) * size)


def _gap(snap: Path) -> None:
    """16 stray bytes between two tensors; later offsets shifted so nothing overlaps."""
    path = _file_of(snap, f"{EMB}.shard_7.weight")
    header, data = _split(path)
    cut = header[f"{EMB}.shard_7.weight"]["data_offsets"][1]
    for key, entry in header.items():
        if key != "__metadata__" and entry["data_offsets"][0] >= cut:
            entry["data_offsets"] = [o + 16 for o in entry["data_offsets"]]
    _rebuild(path, json.dumps(header), data[:cut] + b"\xee" * 16 + data[cut:])


def _symlink_loop(snap: Path) -> None:
    path = _first_file(snap)
    path.unlink()
    path.symlink_to(path.name)


def _index_entry_is_a_directory(snap: Path) -> None:
    (snap / "extra").mkdir()
    _edit_index(snap, lambda m: m.update({"model.vision.proj.weight": "extra"}))


BAD = {
    "no index": (lambda s: (s / "model.safetensors.index.json").unlink(), "index.json is missing"),
    "missing file": (lambda s: _first_file(s).unlink(), "is missing"),
    "no config": (lambda s: (s / "config.json").unlink(), "config.json is missing"),
    "missing shard": (
        lambda s: _edit_index(s, lambda m: m.pop(f"{EMB}.shard_17.weight")),
        r"exactly 0..N-1; missing \[17\]",
    ),
    "no ple": (
        lambda s: _edit_index(s, lambda m: [m.pop(k) for k in list(m) if ".shard_" in k]),
        "no PLE table",
    ),
    "wrong shard count": (
        lambda s: _edit_config(s, lambda c: c.update(split_ngram_parts=64)),
        "split_ngram_parts",
    ),
    "wrong shape": (
        lambda s: _rewrite_header(s, f"{EMB}.shard_3.weight", shape=[2, 132 * 40]),
        "shard_3.weight.*expected U8",
    ),
    "wrong dtype": (
        lambda s: _rewrite_header(s, f"{EMB}.shard_9.weight_scale", dtype="U8"),
        "shard_9.weight_scale.*expected F8_E4M3",
    ),
    "no global scale": (
        lambda s: _edit_index(s, lambda m: m.pop(f"{EMB}.weight_scale_2")),
        "weight_scale_2",
    ),
    "truncated file": (
        lambda s: os.truncate(_first_file(s), _first_file(s).stat().st_size - 100),
        "outside the file",
    ),
    "header garbage": (
        lambda s: _first_file(s).write_bytes(b"\x10\0\0\0\0\0\0\0{{{{{{{{{{{{{{{{"),
        "not valid JSON",
    ),
    "unknown dtype": (
        lambda s: _rewrite_header(s, f"{EMB}.shard_40.weight", dtype="F4"),
        "shard_40.weight'.*unknown dtype",
    ),
    "byte span": (
        lambda s: _rewrite_header(s, f"{EMB}.shard_41.weight", shape=[1, 80]),
        "shard_41.weight'.*needs 80",
    ),
    "overlap": (
        lambda s: _rewrite_header(s, f"{EMB}.shard_42.weight", data_offsets=[0, 132 * 80]),
        "overlap",
    ),
    "absurd header": (
        lambda s: _patch_bytes(_first_file(s), 0, (1 << 40).to_bytes(8, "little")),
        "absurdly large",
    ),
    "eos list": (
        lambda s: _edit_config(s, lambda c: c.update(eos_token_id=[1, 2])),
        "eos_token_id",
    ),
    "duplicate header key": (_duplicate_key, "shard_5.weight' twice"),
    "uncovered data region": (_gap, r"data bytes \[\d+, \d+\) before tensor .* belong to no"),
    "trailing bytes": (
        lambda s: _first_file(s).write_bytes(_first_file(s).read_bytes() + b"\0" * 7),
        "7 trailing bytes",
    ),
    "symlink loop": (_symlink_loop, "symlink loop"),
    "index entry is a directory": (
        _index_entry_is_a_directory,
        "extra is a directory, not a regular file",
    ),
    "duplicate index key": (
        lambda s: (s / "model.safetensors.index.json").write_text(
            (s / "model.safetensors.index.json")
            .read_text()
            .replace('"weight_map": {', f'"weight_map": {{"{EMB}.shard_2.weight": "x",', 1)
        ),
        "shard_2.weight' twice",
    ),
}


def _set_scalar(snap: Path, tensor: str, value: float) -> None:
    """Overwrite a scalar F32 tensor's value in place (header and size unchanged)."""
    path = _file_of(snap, tensor)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    start = json.loads(raw[8 : 8 + n])[tensor]["data_offsets"][0]
    _patch_bytes(path, 8 + n + start, np.float32(value).tobytes())


BAD.update(
    {
        "nan global scale": (
            lambda s: _set_scalar(s, f"{EMB}.weight_scale_2", float("nan")),
            r"weight_scale_2' holds nan, not a positive scale",
        ),
        "zero global scale": (
            lambda s: _set_scalar(s, f"{EMB}.weight_scale_2", 0.0),
            r"weight_scale_2' holds 0.0, not a positive scale",
        ),
    }
)
# The same checks on an FP8 snapshot (one F32 weight_scale, no block scales).
BAD_FP8 = {
    "fp8 nan scale": (
        lambda s: _set_scalar(s, f"{EMB}.weight_scale", float("nan")),
        r"weight_scale' holds nan, not a positive scale",
    ),
    "fp8 zero scale": (
        lambda s: _set_scalar(s, f"{EMB}.weight_scale", 0.0),
        r"weight_scale' holds 0.0, not a positive scale",
    ),
    "fp8 negative scale": (
        lambda s: _set_scalar(s, f"{EMB}.weight_scale", -1.5),
        r"weight_scale' holds -1.5, not a positive scale",
    ),
    "fp8 no scale": (
        lambda s: _edit_index(s, lambda m: m.pop(f"{EMB}.weight_scale")),
        r"weight_scale",
    ),
    "fp8 declared nvfp4": (
        lambda s: _edit_config(s, lambda c: c.update(ple_embedding_dtype="nvfp4")),
        r"ple_embedding_dtype is 'nvfp4' but the shards are F8_E4M3",
    ),
    "fp8 wrong shard dtype": (
        lambda s: _rewrite_header(s, f"{EMB}.shard_2.weight", dtype="U8"),
        r"shard_2.weight.*expected F8_E4M3",
    ),
}


def _refused(snap: Path, out: Path, message: str) -> None:
    import re

    res = cli("build-table", snap, out)
    assert res.returncode == 1, res.stderr
    assert re.search(message, res.stderr), res.stderr
    assert "nothing new was published" in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.splitlines()) == 2, res.stderr
    assert not out.exists()


@pytest.mark.parametrize("case", BAD_FP8, ids=list(BAD_FP8))
def test_bad_fp8_input_is_refused_and_writes_nothing(snapshots, tmp_path, case):
    snap = tmp_path / "snap"
    shutil.copytree(snapshots("fp8-3files", quant="fp8", files=3), snap)
    breaker, message = BAD_FP8[case]
    breaker(snap)
    _refused(snap, tmp_path / "t", message)


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_is_refused_and_writes_nothing(snapshots, tmp_path, case):
    snap = tmp_path / "snap"
    shutil.copytree(snapshots("nvfp4", files=3), snap)
    breaker, message = BAD[case]
    breaker(snap)
    res = cli("build-table", snap, tmp_path / "t")
    assert res.returncode == 1, res.stderr
    import re

    assert re.search(message, res.stderr), res.stderr
    assert "nothing new was published" in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.splitlines()) == 2, res.stderr
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("which", ["shard", "index", "config"])
def test_a_fifo_in_the_snapshot_is_refused_without_blocking(snapshots, tmp_path, which):
    """A FIFO would block open() forever; it is refused at once (a real subprocess, timed)."""
    snap = tmp_path / "snap"
    shutil.copytree(snapshots("nvfp4", files=3), snap)
    path = {
        "shard": _first_file(snap),
        "index": snap / "model.safetensors.index.json",
        "config": snap / "config.json",
    }[which]
    path.unlink()
    os.mkfifo(path)
    t0 = time.monotonic()
    res = run_cli("build-table", snap, tmp_path / "t")  # times out (fails) if open() blocks
    assert time.monotonic() - t0 < 30
    assert res.returncode == 1, res.stderr
    assert f"{path} is a FIFO, not a regular file" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "t").exists()


def test_an_unusable_out_dir_is_one_line_exit_1(snapshots, tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    res = run_cli("build-table", snapshots("nvfp4", files=3), loop / "t")
    assert res.returncode == 1, res.stderr
    assert "symlink loop" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.splitlines()) == 2


# ------------------------------------------------------------------ crash safety


def test_sigkill_at_random_moments_never_publishes_a_partial_table(snapshots, tmp_path):
    # about 22 MiB of rows in 64 KiB chunks: a build takes long enough to be hit mid-way
    snap = snapshots("kill", vocab_base=16_000, files=4)
    out = tmp_path / "t"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "sparkple.cli",
        "build-table",
        str(snap),
        str(out),
        "--chunk-mib",
        "0.0625",
        "--quiet",
    ]
    t0 = time.monotonic()
    assert subprocess.run(cmd, env=env).returncode == 0
    full = time.monotonic() - t0
    shutil.rmtree(out)
    rng = random.Random(1234)
    published_seen = 0
    for _ in range(8):
        proc = subprocess.Popen(cmd, env=env)
        deadline = time.monotonic() + rng.uniform(0.05, full * 1.1)
        while time.monotonic() < deadline and proc.poll() is None:
            _assert_consistent(out)  # a concurrent reader never sees half a table
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if _assert_consistent(out):
            published_seen += 1
            shutil.rmtree(out)  # start the next round from nothing again
    res = subprocess.run(cmd, env=env)
    assert res.returncode == 0
    meta = read_meta(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [".build.lock", META_NAME, meta.data_file]
    )
    assert verify_table(snap, out, full=True, quiet=True) == []
    assert published_seen < 8  # most kills landed mid-build


def _assert_consistent(out: Path) -> bool:
    """True if a complete table is published; fails the test on a half-published one."""
    if not (out / META_NAME).exists():
        return False
    meta = read_meta(out)  # raises if table.json names a missing or short data file
    assert meta.data_path(out).stat().st_size == meta.data_bytes
    return True


def test_leftovers_of_a_killed_build_are_cleaned(snapshots, tmp_path):
    snap, out = snapshots("nvfp4", files=3), tmp_path / "t"
    out.mkdir()
    (out / ".tmp-rows-x.bin").write_bytes(b"\0" * 100)
    (out / ".tmp-x-table.json").write_text("{}")
    (out / "rows-orphan.bin").write_bytes(b"\0" * 100)
    res = cli("build-table", snap, out)
    assert res.returncode == 0 and "leftovers" in res.stderr
    meta = read_meta(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [".build.lock", META_NAME, meta.data_file]
    )


def test_a_failed_write_removes_its_temporary_files(snapshots, tmp_path):
    """The kernel refuses writes past RLIMIT_FSIZE (EFBIG): the build fails cleanly."""
    import resource

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    out = tmp_path / "t"
    res = run_cli("build-table", snapshots("nvfp4", files=3), out, preexec_fn=limit_file_size)
    assert res.returncode == 1
    assert "cannot write the table" in res.stderr and "nothing new was published" in res.stderr
    assert [p.name for p in out.iterdir()] == [".build.lock"]


def test_a_second_concurrent_build_is_refused(snapshots, tmp_path):
    import fcntl

    out = tmp_path / "t"
    out.mkdir()
    with open(out / ".build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        res = cli("build-table", snapshots("nvfp4", files=3), out)
    assert res.returncode == 1 and "another build" in res.stderr
    assert [p.name for p in out.iterdir()] == [".build.lock"]
