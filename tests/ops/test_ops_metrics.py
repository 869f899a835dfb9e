"""The textfile metrics against a real table file on disk, a real reader process faulting its
pages in, the real page cache (mincore), /proc/diskstats and /proc/<pid>/stat."""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from ops_helpers import ROOT, program

from sparkple.runtime.pagecache import file_resident_pages
from sparkple.runtime.stats import PLEStats, StatsFile
from sparkple.runtime.tablemeta import FORMAT_VERSION, SourceFingerprint, TableMeta
from sparkple.supervise.devices import block_device, device_names
from sparkple.supervise.state import SUPERVISOR_STATES

ROW = 90
TABLE_BYTES = 16 * 1024 * 1024 - (16 * 1024 * 1024) % ROW  # whole rows, about 16 MiB


def parse(text: str) -> dict[str, float]:
    """Samples of a text exposition, keyed by `name{labels}` as written."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def collect(out: Path, *args: object) -> dict[str, float]:
    done = subprocess.run(
        program("metrics", "--out", out, *args), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return parse(out.read_text())


@pytest.fixture
def table(tmp_path: Path) -> Path:
    """A published table dir on a real disk, evicted from the page cache."""
    table_dir = tmp_path / "table"
    table_dir.mkdir()
    data = table_dir / "rows-test.bin"
    with open(data, "wb") as f:
        f.write(os.urandom(TABLE_BYTES))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    rows = TABLE_BYTES // ROW
    meta = TableMeta(
        format_version=FORMAT_VERSION, data_file=data.name, data_bytes=TABLE_BYTES,
        quant="nvfp4", ple_prefix="model.ple", vllm_param="ple",
        total_rows=rows, rows_per_shard=rows, shards=1, num_heads=1, head_dim=2 * (ROW - 10),
        head_sizes=[rows], head_offsets=[0], ngram_size=2, heads_per_ngram=1, eos_token_id=0,
        vocab_size=rows, multipliers=[1],
        row_width=ROW, codes_width=ROW - 10, scales_width=10, codes_dtype="uint8",
        scales_dtype="float8_e4m3fn", global_scale=1.0,
        source=SourceFingerprint(snapshot_id="test", files=[], index_sha256=""),
        builder_version="test", built_at="",
    )  # fmt: skip
    (table_dir / "table.json").write_text(meta.to_json())
    resident, total = file_resident_pages(data)
    if resident > total // 20:
        pytest.skip(f"{data} stays in the page cache after DONTNEED (tmpfs?): cannot go cold")
    return table_dir


class Reader(subprocess.Popen[str]):
    """table_reader.py running: gather(first, count) has it read rows, which it counts in
    stats_dir."""

    gather: Callable[[int, int], None]
    stats_dir: Path


@pytest.fixture
def reader(table: Path, tmp_path: Path):
    stats_dir = tmp_path / "stats"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = Reader(
        [sys.executable, str(Path(__file__).with_name("table_reader.py")),
         str(table / "rows-test.bin"), str(stats_dir)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert p.stdin is not None and p.stdout is not None
    stdin, stdout = p.stdin, p.stdout
    assert stdout.readline().strip() == "ready"

    def gather(first: int, count: int) -> None:
        stdin.write(f"gather {first} {count} {ROW}\n")
        stdin.flush()
        assert stdout.readline().startswith("ok ")

    p.gather = gather
    p.stats_dir = stats_dir
    yield p
    stdin.write("quit\n")
    stdin.close()
    p.wait(10)


def test_values_move_when_lookups_happen(tmp_path, table, reader):
    out = tmp_path / "textfile" / "sparkple.prom"
    args = ("--table-dir", table, "--pid", reader.pid, "--stats-dir", reader.stats_dir)
    before = collect(out, *args)
    rows = TABLE_BYTES // ROW
    reader.gather(0, rows // 2)  # every page of the first half, one cold fault each
    after = collect(out, *args)

    assert before["sparkple_ple_table_published"] == 1
    assert before["sparkple_ple_table_size_bytes"] == TABLE_BYTES
    assert before["sparkple_ple_table_resident_ratio"] < 0.05
    assert 0.45 <= after["sparkple_ple_table_resident_ratio"] <= 0.6
    assert after["sparkple_ple_table_resident_bytes"] >= TABLE_BYTES * 0.45
    pages = TABLE_BYTES // 2 // mmap.PAGESIZE
    faults = after["sparkple_serving_major_faults_total"]
    faults -= before["sparkple_serving_major_faults_total"]
    assert faults >= pages * 0.5, f"{faults} major faults for {pages} cold pages (MADV_RANDOM)"
    device = block_device(table / "rows-test.bin")
    key = f'sparkple_ple_disk_read_bytes_total{{device="{device}"}}'
    if device is not None:  # other processes add reads too; ours are at least the half table
        assert after[key] - before[key] >= TABLE_BYTES // 2 * 0.9
    assert before["sparkple_ple_rows_gathered_total"] == 0
    assert after["sparkple_ple_rows_gathered_total"] == rows // 2
    assert after["sparkple_ple_gather_calls_total"] == 1
    assert after["sparkple_ple_handshake_wait_seconds_count"] == 1
    assert after["sparkple_ple_handshake_wait_seconds_sum"] > 0
    assert after['sparkple_ple_handshake_wait_seconds_bucket{le="+Inf"}'] == 1
    assert after["sparkple_ple_stats_writers"] == 1 and after["sparkple_serving_up"] == 1
    assert after["sparkple_mem_available_bytes"] > 0 and after["sparkple_page_cache_bytes"] > 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["sparkple.prom"], "no temp left"


def test_promtool_accepts_the_file(tmp_path, table, reader):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus; make setup does it)")
    state = tmp_path / "state"
    (state / "markers").mkdir(parents=True)
    (state / "markers" / "emergency-20260101T000000.000000Z.json").write_text("{}")
    (state / "supervisor.json").write_text(json.dumps({"state": "backoff"}))
    device = block_device(table)
    assert device, f"{table} is on no block device: the table I/O error count needs one"
    disk = device_names(device)[-1]
    kmsg = tmp_path / "kmsg"  # a saved kernel log, read like /dev/kmsg
    kmsg.write_text(
        "4,1,10,-;NVRM: Xid (PCI:000f:01:00): 13, pid=99, name=python3\n"
        "4,2,20,-;NVRM: kgspRcAndNotifyAllChannels: NV_ERR_NO_MEMORY\n"
        "4,3,30,-;NVRM: Xid (PCI:000f:01:00): 31, pid=99, name=python3\n"
        "6,4,40,-;eth0: link up\n"
        # I/O errors: two on the table's disk (the block layer names the disk), one elsewhere
        f"3,5,50,-;blk_update_request: I/O error, dev {disk}, sector 2048 op 0x0:(READ)\n"
        f"3,6,60,-;{disk}: critical medium error, dev {disk}, sector 4096\n"
        "3,7,70,-;blk_update_request: I/O error, dev zzz9, sector 1 op 0x0:(READ)\n"
    )
    reader.gather(0, 1000)
    out = tmp_path / "sparkple.prom"
    samples = collect(
        out,
        "--table-dir", table,
        "--pid", reader.pid,
        "--stats-dir", reader.stats_dir,
        "--state-dir", state,
        "--kmsg", kmsg,
    )  # fmt: skip
    assert samples['sparkple_kernel_errors{kind="xid"}'] == 2
    assert samples['sparkple_kernel_errors{kind="nv_err_no_memory"}'] == 1
    assert samples['sparkple_kernel_errors{kind="table_io"}'] == 2
    assert samples['sparkple_ops_incidents_total{kind="emergency"}'] == 1
    assert samples['sparkple_supervisor_state{state="backoff"}'] == 1
    with open(out) as f:
        checked = subprocess.run(
            [promtool, "check", "metrics"], stdin=f, capture_output=True, text=True, timeout=60
        )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.strip() == "" and checked.stderr.strip() == "", "no lint findings"


def test_stats_written_by_sparkple_stats_are_read_and_merged(tmp_path):
    stats_dir = tmp_path / "stats"
    a, b = PLEStats(), PLEStats()
    a.add("rows_gathered", 32768)
    a.add("pages_prefetched", 9000)
    a.add("staging_overruns")
    for seconds in (0.0001, 0.0004, 0.002, 400.0):
        a.observe_wait(seconds)
    b.add("rows_gathered", 16)
    b.observe_wait(0.0002)
    for stats, name in ((a, "ple-stats-1.json"), (b, "ple-stats-2.json")):
        writer = StatsFile(stats_dir, stats)
        writer.path = stats_dir / name  # two processes' files in one test process
        writer.write()
    stale = json.loads((stats_dir / "ple-stats-2.json").read_text())
    stale["updated_at"] -= 3600
    stale["counters"]["rows_gathered"] = 10**9
    (stats_dir / "ple-stats-3.json").write_text(json.dumps(stale))  # a writer long gone
    (stats_dir / "ple-stats-4.json").write_text("{not json")

    out = tmp_path / "m.prom"
    done = subprocess.run(
        program("metrics", "--out", out, "--stats-dir", stats_dir),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and "ple-stats-4.json: unreadable" in done.stderr
    m = parse(out.read_text())
    assert m["sparkple_ple_stats_writers"] == 2
    assert m["sparkple_ple_rows_gathered_total"] == 32768 + 16
    assert m["sparkple_ple_pages_prefetched_total"] == 9000
    assert m["sparkple_ple_staging_overruns_total"] == 1
    bucket = 'sparkple_ple_handshake_wait_seconds_bucket{{le="{}"}}'.format
    assert m[bucket("0.0001")] == 1
    assert m[bucket("0.00025")] == 2
    assert m[bucket("0.0005")] == 3
    assert m[bucket("0.0025")] == 4
    assert m[bucket("300.0")] == 4
    assert m[bucket("+Inf")] == 5 == m["sparkple_ple_handshake_wait_seconds_count"]
    assert m["sparkple_ple_handshake_wait_seconds_sum"] == pytest.approx(400.0027)


def test_missing_sources_drop_only_their_metrics(tmp_path):
    out = tmp_path / "m.prom"
    done = subprocess.run(
        program(
            "metrics", "--out", out,
            "--table-dir", tmp_path / "no-table",
            "--pid", 2**22 + 1,
        ),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and "no published table" in done.stderr
    m = parse(out.read_text())
    assert m["sparkple_ple_table_published"] == 0 and m["sparkple_serving_up"] == 0
    assert "sparkple_mem_free_bytes" in m


def test_the_output_must_be_a_prom_file(tmp_path):
    done = subprocess.run(
        program("metrics", "--out", tmp_path / "m.txt"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and ".prom" in done.stderr
    assert not (tmp_path / "m.txt").exists()


def test_a_slow_reader_never_sees_a_partial_file(tmp_path):
    out = tmp_path / "m.prom"
    collect(out)
    with open(out) as held:  # a scrape in progress keeps the old inode
        first = held.read()
        time.sleep(0.01)
        collect(out)
        held.seek(0)
        assert held.read() == first
    assert out.read_text().endswith("\n") and out.stat().st_mode & 0o777 == 0o644


def test_every_supervisor_state_has_a_gauge():
    """The metrics export one gauge per state in sparkple.supervise.state.SUPERVISOR_STATES: every
    state the supervisor writes must be there, or its gauges all read 0 while it is in it."""
    # the modules that write the supervisor's state: its loop and the maintenance relaunch
    source = "".join(
        (ROOT / "sparkple" / "supervise" / name).read_text()
        for name in ("supervisor_cli.py", "supervisor.py", "maintenance.py")
    )
    written = set(re.findall(r"""(?:state=|"state": |\["state"\] = )"([a-z-]+)\"""", source))
    assert {"starting", "running", "reset"} <= written  # the pattern finds all three spellings
    assert written <= set(SUPERVISOR_STATES)
