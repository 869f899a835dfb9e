"""Strict safetensors reading: every malformed input is a CheckpointError naming file and tensor."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from sparkple.builder.safetensors_io import Snapshot, read_header
from sparkple.errors import CheckpointError


def write_raw(path: Path, header: object, data: bytes, header_len: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def good_header() -> dict:
    return {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "U8", "shape": [2, 3], "data_offsets": [0, 6]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [6, 14]},
    }


def test_reads_memmaps_at_the_right_offsets(tmp_path):
    data = bytes(range(6)) + np.array([1.5, -2.0], dtype="<f4").tobytes()
    path = write_raw(tmp_path / "m.safetensors", good_header(), data)
    tensors = read_header(path)
    a = tensors["a"].memmap()
    assert isinstance(a, np.memmap) and a.shape == (2, 3) and a.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert not a.flags.writeable
    assert tensors["b"].read().tolist() == [1.5, -2.0]


def test_agrees_with_the_safetensors_library(snapshots):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    snap = Snapshot(snapshots("nvfp4", files=3))
    for file in snap.file_names:
        with safe_open(str(snap.dir / file), framework="pt") as f:
            for name in list(f.keys())[:20]:
                ref = f.get_tensor(name)
                ours = snap.tensor(name).memmap()
                ref_bytes = ref.contiguous().view(torch.uint8).numpy().tobytes()
                assert tuple(ref.shape) == ours.shape and ref_bytes == ours.tobytes(), name


def corrupt(header: dict, tensor: str, **changes) -> dict:
    header = json.loads(json.dumps(header))
    header[tensor].update(changes)
    return header


CASES = {
    "header past end": (good_header(), 14, 10_000, "runs past the end"),
    "absurd header": (good_header(), 14, 1 << 40, "absurdly large"),
    "not json": (b"{not json", 14, None, "not valid JSON"),
    "not an object": ([1, 2], 14, None, "JSON object"),
    "entry shape": ({"a": {"dtype": "U8"}}, 14, None, "'a'.*needs dtype"),
    "shape not list": (corrupt(good_header(), "a", shape="2x3"), 14, None, "'a'.*shape"),
    "unknown dtype": (corrupt(good_header(), "b", dtype="F4"), 14, None, "'b'.*unknown dtype"),
    "outside file": (corrupt(good_header(), "b", data_offsets=[6, 400]), 14, None, "'b'.*outside"),
    "reversed": (corrupt(good_header(), "b", data_offsets=[14, 6]), 14, None, "'b'.*outside"),
    "overlap": (
        corrupt(corrupt(good_header(), "b", data_offsets=[4, 12]), "a", data_offsets=[0, 6]),
        14,
        None,
        "overlap",
    ),
    "span": (corrupt(good_header(), "a", shape=[2, 4]), 14, None, "'a'.*needs 8"),
    "trailing bytes": (good_header(), 20, None, "6 trailing bytes"),
    "gap": (
        corrupt(corrupt(good_header(), "b", data_offsets=[8, 16]), "a", data_offsets=[0, 6]),
        16,
        None,
        r"data bytes \[6, 8\) before tensor 'b' belong to no tensor",
    ),
    "gap at start": (
        corrupt(corrupt(good_header(), "a", data_offsets=[2, 8]), "b", data_offsets=[8, 16]),
        16,
        None,
        r"data bytes \[0, 2\) before tensor 'a'",
    ),
    "duplicate key": (
        b'{"a":{"dtype":"U8","shape":[2,3],"data_offsets":[0,6]},'
        b'"b":{"dtype":"F32","shape":[2],"data_offsets":[6,14]},'
        b'"a":{"dtype":"U8","shape":[2,3],"data_offsets":[14,20]}}',
        20,
        None,
        "names 'a' twice",
    ),
}

# The cases the safetensors library itself refuses (our reader must refuse at least these).
LIBRARY_REFUSES = ["trailing bytes", "gap", "gap at start", "duplicate key", "overlap"]


@pytest.mark.parametrize("case", LIBRARY_REFUSES)
def test_the_safetensors_library_refuses_the_same_files(tmp_path, case):
    """Grounds the rules above in the reference reader, so they are not our invention."""
    safetensors = pytest.importorskip("safetensors")
    header, data_len, header_len, _ = CASES[case]
    path = write_raw(tmp_path / "bad.safetensors", header, b"\0" * data_len, header_len)
    with pytest.raises(Exception):  # noqa: B017 - SafetensorError is not importable by name
        safetensors.safe_open(str(path), framework="numpy")
    good = write_raw(tmp_path / "good.safetensors", good_header(), b"\0" * 14)
    with safetensors.safe_open(str(good), framework="numpy") as f:
        assert sorted(f.keys()) == ["a", "b"]


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_bad_headers(tmp_path, case):
    header, data_len, header_len, message = CASES[case]
    path = write_raw(tmp_path / "bad.safetensors", header, b"\0" * data_len, header_len)
    with pytest.raises(CheckpointError, match=message) as err:
        read_header(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("kind", ["fifo", "directory", "loop"])
def test_only_regular_files_are_read(tmp_path, kind):
    path = tmp_path / "x.safetensors"
    if kind == "fifo":
        os.mkfifo(path)  # a blocking open() would hang this test forever
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(path.name)
    want = {"fifo": "is a FIFO, not a regular file", "directory": "is a directory", "loop": "loop"}
    with pytest.raises(CheckpointError, match=want[kind]):
        read_header(path)


def test_short_file(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\1\2")
    with pytest.raises(CheckpointError, match="too short"):
        read_header(path)


def test_missing_index_and_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is missing"):
        Snapshot(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00001-of-00001.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="model-00001-of-00001.safetensors is missing"):
        Snapshot(tmp_path).tensor("x")


@pytest.mark.parametrize(
    "index",
    [
        "{",
        json.dumps([1]),
        json.dumps({"weight_map": {"x": 3}}),
        json.dumps({"weight_map": {"x": "../f"}}),
    ],
)
def test_bad_index(tmp_path, index):
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match="index.json"):
        Snapshot(tmp_path)


def test_tensor_listed_but_not_in_file(tmp_path):
    write_raw(tmp_path / "f.safetensors", good_header(), b"\0" * 14)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "f.safetensors", "zz": "f.safetensors"}})
    )
    snap = Snapshot(tmp_path)
    assert snap.tensor("a").shape == (2, 3)
    with pytest.raises(CheckpointError, match="'zz' is listed in the index but not"):
        snap.tensor("zz")
