"""The table commands: `sparkple build-table`, `verify-table` and `inspect-table`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    SparkpleError,
)
from ..runtime.tablemeta import (
    TableMeta,
)
from .build import build_table
from .safetensors_io import describe_oserror
from .stream import DEFAULT_CHUNK_MIB, MAX_CHUNK_MIB
from .verify import DEFAULT_VERIFY_ROWS, inspect_table, verify_table


def add_parser(subparsers: Any, name: str) -> None:
    if name == "build-table":
        p = subparsers.add_parser(name, help="pack a snapshot's PLE shards into one row file")
        p.add_argument("snapshot", type=Path, help="HF snapshot directory (with the index)")
        p.add_argument("out_dir", type=Path, help="table directory (table.json + rows-*.bin)")
        p.add_argument(
            "--force", action="store_true", help="rebuild a table whose metadata does not match"
        )
        p.add_argument(
            "--rebuild", action="store_true", help="rebuild even a table that is up to date"
        )
        p.add_argument(
            "--chunk-mib", type=float, default=DEFAULT_CHUNK_MIB, help="rows copied per chunk (MiB)"
        )
        p.add_argument(
            "--verify-rows",
            type=int,
            default=DEFAULT_VERIFY_ROWS,
            help="random rows compared with the source before publishing",
        )
        p.add_argument("--quiet", action="store_true", help="no progress output")
        p.set_defaults(func=_run_build)
    elif name == "verify-table":
        p = subparsers.add_parser(name, help="compare a published table with its snapshot")
        p.add_argument("snapshot", type=Path)
        p.add_argument("out_dir", type=Path)
        mode = p.add_mutually_exclusive_group()
        mode.add_argument("--full", action="store_true", help="compare every byte")
        mode.add_argument(
            "--sample", type=int, default=DEFAULT_VERIFY_ROWS, help="random rows to compare"
        )
        p.add_argument("--quiet", action="store_true")
        p.set_defaults(func=_run_verify)
    elif name == "inspect-table":
        p = subparsers.add_parser(name, help="print a published table's metadata and health")
        p.add_argument("out_dir", type=Path)
        p.add_argument("--json", action="store_true", help="one JSON object on stdout")
        p.set_defaults(func=_run_inspect)
    else:
        raise ValueError(f"sparkple.builder.tablecli has no subcommand {name!r}")


def _usage(msg: str) -> int:
    print(msg, file=sys.stderr)
    return EXIT_USAGE


def _run_build(args: argparse.Namespace) -> int:
    if not args.snapshot.is_dir():
        return _usage(f"build-table: {args.snapshot} is not a directory (expected a HF snapshot)")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        return _usage(f"build-table: {args.out_dir} exists and is not a directory")
    if args.chunk_mib <= 0 or args.chunk_mib > MAX_CHUNK_MIB or args.verify_rows < 0:
        return _usage(
            f"build-table: --chunk-mib must be in (0, {MAX_CHUNK_MIB}] and --verify-rows >= 0"
        )
    t0 = time.monotonic()
    try:
        status, meta = build_table(
            args.snapshot,
            args.out_dir,
            force=args.force,
            rebuild=args.rebuild,
            chunk_mib=args.chunk_mib,
            verify_count=args.verify_rows,
            quiet=args.quiet,
        )
    except SparkpleError as exc:
        print(f"build-table: {exc}\nnothing new was published in {args.out_dir}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    except OSError as exc:
        print(
            f"build-table: {describe_oserror(exc)}\nnothing new was published in {args.out_dir}",
            file=sys.stderr,
        )
        return EXIT_CHECK_FAILED
    where = meta.data_path(args.out_dir)
    if status == "up-to-date":
        print(f"build-table: {where} is up to date with {args.snapshot}; nothing to do")
    else:
        dt = time.monotonic() - t0
        print(
            f"build-table: published {where} ({meta.total_rows} rows x {meta.row_width} B = "
            f"{meta.data_bytes / 2**30:.2f} GiB) in {dt:.1f} s ({_phases(meta)})"
        )
    return EXIT_OK


def _phases(meta: TableMeta) -> str:
    b = meta.extra.get("build", {})
    return (
        f"copy {b.get('copy_s', 0):.1f} s, fsync {b.get('fsync_s', 0):.1f} s, "
        f"verify {b.get('verified_rows', 0)} rows {b.get('verify_s', 0):.1f} s"
    )


def _run_verify(args: argparse.Namespace) -> int:
    if not args.snapshot.is_dir():
        return _usage(f"verify-table: {args.snapshot} is not a directory (expected a HF snapshot)")
    try:
        problems = verify_table(
            args.snapshot, args.out_dir, full=args.full, sample=args.sample, quiet=args.quiet
        )
    except SparkpleError as exc:
        print(f"verify-table: {exc}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    except OSError as exc:
        print(f"verify-table: {describe_oserror(exc)}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    for p in problems:
        print(f"verify-table: {p}", file=sys.stderr)
    if problems:
        print(
            f"verify-table: {args.out_dir} does not match {args.snapshot}; "
            "rebuild with build-table --force",
            file=sys.stderr,
        )
        return EXIT_CHECK_FAILED
    print(
        f"verify-table: {args.out_dir} matches {args.snapshot} "
        f"({'every byte' if args.full else 'sampled rows'})"
    )
    return EXIT_OK


def _run_inspect(args: argparse.Namespace) -> int:
    try:
        info = inspect_table(args.out_dir)
    except SparkpleError as exc:
        if args.json:
            print(json.dumps({"healthy": False, "error": str(exc)}))
        print(f"inspect-table: {exc}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    if args.json:
        print(json.dumps(info, sort_keys=True))
        return EXIT_OK
    src = info["source"]
    lines = [
        f"table       {info['meta_path']}",
        f"data        {info['data_path']} ({info['data_bytes']} B, {info['table_gib']} GiB)",
        f"format      v{info['format_version']} {info['quant']}, row {info['row_width']} B = "
        f"{info['codes_width']} codes + {info['scales_width']} scales, "
        f"global scale {info['global_scale']:.6g}",
        f"geometry    {info['total_rows']} rows, "
        f"{info['shards']} shards x {info['rows_per_shard']}, "
        f"{info['num_heads']} heads x {info['head_dim']}",
        f"parameter   {info['vllm_param']}",
        f"source      snapshot {src['snapshot_id']}, {len(src['files'])} files, "
        f"index sha256 {src['index_sha256'][:16]}",
        f"built       {info['built_at']} by {info['builder_version']}",
        f"fingerprint {info['fingerprint']}",
        "health      ok (published, data file size matches)",
    ]
    print("\n".join(lines))
    return EXIT_OK
