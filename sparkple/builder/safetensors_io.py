"""Strict, zero-copy reading of a HF safetensors snapshot (index + shard files).

Headers are parsed once; tensor data is never loaded: callers get read-only numpy memmaps or
absolute byte ranges to stream from. Anything malformed raises CheckpointError naming the
file and, where there is one, the tensor. Reading headers needs only the standard library (the
serving plan does it with the host's python3); numpy comes in with the first memmap.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError

if TYPE_CHECKING:
    import numpy as np

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # real headers are a few MiB at most

# safetensors dtype -> (bytes per element, numpy dtype used to view the raw bytes)
DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "F8_E4M3": (1, "uint8"),
    "F8_E5M2": (1, "uint8"),
    "I16": (2, "<i2"),
    "U16": (2, "<u2"),
    "F16": (2, "<f2"),
    "BF16": (2, "<u2"),
    "I32": (4, "<i4"),
    "U32": (4, "<u4"),
    "F32": (4, "<f4"),
    "I64": (8, "<i8"),
    "U64": (8, "<u8"),
    "F64": (8, "<f8"),
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    def memmap(self) -> np.ndarray:
        """A read-only view of the tensor's bytes (nothing is read until touched)."""
        import numpy as np  # here: the serving plan reads headers with the standard library only

        np_dtype = np.dtype(DTYPES[self.dtype][1])
        if self.nbytes == 0:
            return np.empty(self.shape, dtype=np_dtype)
        return np.memmap(self.path, dtype=np_dtype, mode="r", offset=self.offset, shape=self.shape)

    def read(self) -> np.ndarray:
        """A small tensor's values, read into memory (for scalars and hash buffers)."""
        import numpy as np

        return np.array(self.memmap())


def open_regular(path: Path, what: str = "file") -> tuple[int, int]:
    """Open a file that must be a regular file, without blocking: (fd, size).

    O_NONBLOCK keeps a FIFO (or a device) in place of a snapshot file from hanging the
    caller in open(); anything but a regular file is refused before a byte is read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; the snapshot is incomplete") from None
    except OSError as exc:
        raise CheckpointError(f"cannot open {what} {path}: {_oserror(exc)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(
                f"{path} is {_kind(st.st_mode)}, not a regular file; replace it with the "
                f"{what} from the snapshot"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_regular(path: Path, what: str = "file") -> bytes:
    """The whole content of a small file that must be a regular file (see open_regular)."""
    fd, size = open_regular(path, what)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError as exc:
        raise CheckpointError(f"cannot read {what} {path}: {_oserror(exc)}") from None
    finally:
        os.close(fd)


def describe_oserror(exc: OSError) -> str:
    """One line for an OS error: the path and what went wrong, no traceback."""
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{_oserror(exc)}"


def _oserror(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "too many levels of symbolic links (a symlink loop); fix or replace the link"
    return exc.strerror or str(exc)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a plain file"


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _strict_json(raw: bytes, where: str, why: str) -> object:
    """JSON that names no key twice (a file naming a tensor twice is corrupt or hand-edited)."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except _DuplicateKey as exc:
        raise CheckpointError(
            f"{where} names {exc.key!r} twice; {why}, download it again"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where} is not valid JSON ({exc})") from exc


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header (see read_header_sized)."""
    return read_header_sized(path)[0]


def read_header_sized(path: Path) -> tuple[dict[str, TensorInfo], int]:
    """Parse and validate one safetensors file's header; also returns the file's size.

    The rules are the `safetensors` library's: no duplicate keys, and the tensors' data
    regions tile the data section exactly (no overlap, no gap, no trailing bytes).
    """
    fd, size = open_regular(path, "safetensors file")
    try:
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{path}: header length {header_len} is absurdly large (limit "
                f"{MAX_HEADER_BYTES}); the file is corrupt or not safetensors"
            )
        if 8 + header_len > size:
            raise CheckpointError(
                f"{path}: header length {header_len} runs past the end of the {size}-byte "
                "file; the file is truncated or corrupt, download it again"
            )
        raw = os.pread(fd, header_len, 8)
    except OSError as exc:
        raise CheckpointError(f"cannot read safetensors file {path}: {_oserror(exc)}") from None
    finally:
        os.close(fd)
    if len(raw) != header_len:
        raise CheckpointError(f"{path}: the file shrank while its header was read; retry")
    header = _strict_json(
        raw,
        f"{path}: header",
        "the safetensors library refuses such a file (it is corrupt or hand-edited)",
    )
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object of tensors")
    data_start = 8 + header_len
    data_size = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor_entry(path, name, entry, data_start, data_size)
    _check_coverage(path, tensors, data_start, data_size)
    return tensors, size


def _check_coverage(
    path: Path, tensors: dict[str, TensorInfo], data_start: int, data_size: int
) -> None:
    """The data regions, sorted, must follow each other from 0 to the end of the file."""
    spans = sorted(
        (t.offset - data_start, t.offset - data_start + t.nbytes, t.name) for t in tensors.values()
    )
    end, last = 0, None
    for begin, stop, name in spans:
        if begin < end:
            raise CheckpointError(
                f"{path}: tensors {last!r} and {name!r} overlap; the file is corrupt"
            )
        if begin > end:
            raise CheckpointError(
                f"{path}: data bytes [{end}, {begin}) before tensor {name!r} belong to no "
                "tensor (the safetensors library refuses a file not fully covered); the file "
                "is corrupt"
            )
        end, last = stop, name
    if end != data_size:
        raise CheckpointError(
            f"{path}: {data_size - end} trailing bytes after the last tensor's data (the "
            "safetensors library refuses a file not fully covered); the file is corrupt or "
            "was appended to, download it again"
        )


def _tensor_entry(
    path: Path, name: str, entry: object, data_start: int, data_size: int
) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise CheckpointError(f"{where}: header entry needs dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative ints")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets)):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if begin > end or end > data_size:
        raise CheckpointError(
            f"{where}: data_offsets [{begin}, {end}] lie outside the file's {data_size} data "
            "bytes; the file is truncated or corrupt"
        )
    expected = math.prod(shape) * DTYPES[dtype][0]
    if end - begin != expected:
        raise CheckpointError(
            f"{where}: spans {end - begin} bytes but shape {shape} x {dtype} needs {expected}"
        )
    return TensorInfo(name, path, dtype, tuple(shape), data_start + begin, end - begin)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class Snapshot:
    """A HF snapshot directory: its index and the headers of the files it names."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.index_path = self.dir / INDEX_NAME
        if not os.path.lexists(self.index_path):
            raise CheckpointError(
                f"{self.index_path} is missing: {self.dir} is not a sharded HF snapshot "
                "(or the download is incomplete)"
            )
        self.index_bytes = read_regular(self.index_path, "index")
        index = _strict_json(
            self.index_bytes, str(self.index_path), "the index is corrupt or hand-edited"
        )
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(
                f"{self.index_path}: needs a 'weight_map' object of tensor name -> file name"
            )
        for name, file in weight_map.items():
            if os.path.basename(file) != file or file in ("", ".", ".."):
                raise CheckpointError(
                    f"{self.index_path}: tensor {name!r} maps to bad file {file!r}"
                )
        self.weight_map: dict[str, str] = weight_map
        self._headers: dict[str, dict[str, TensorInfo]] = {}
        self._sizes: dict[str, int] = {}

    @property
    def file_names(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def header(self, file: str) -> dict[str, TensorInfo]:
        if file not in self._headers:
            self._headers[file], self._sizes[file] = read_header_sized(self.dir / file)
        return self._headers[file]

    def file_size(self, file: str) -> int:
        """The size of a file the index names, once its header has been validated."""
        self.header(file)
        return self._sizes[file]

    def check_all(self) -> None:
        """Validate every file the index names and every tensor it lists, not only those used.

        A snapshot that vLLM (or the safetensors library) would refuse is refused here too,
        before anything is built from it.
        """
        for name in self.weight_map:
            self.tensor(name)

    def tensor(self, name: str) -> TensorInfo:
        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError(f"{self.index_path}: no tensor {name!r} in the weight_map")
        info = self.header(file).get(name)
        if info is None:
            raise CheckpointError(
                f"{self.dir / file}: tensor {name!r} is listed in the index but not in this "
                "file's header; the snapshot is inconsistent"
            )
        return info

    def config(self) -> dict[str, Any]:
        path = self.dir / "config.json"
        raw = read_regular(path, "config.json")
        try:
            cfg = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path} is not readable JSON ({exc})") from exc
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{path} must hold a JSON object")
        return cfg
