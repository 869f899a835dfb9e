"""`supervisor status --json` as playbooks/status.yml reads it: MemAvailable now (the package's
meminfo reader) and the state of the table published in --table-dir (the package's metadata
reader: published, broken or missing, with why), from a real table and a real process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from ops_helpers import ROOT

from sparkple.runtime.tablemeta import read_meta


def status(tmp_path: Path, table_dir: Path) -> dict:
    (tmp_path / "state").mkdir(exist_ok=True)
    (tmp_path / "kmsg").touch()
    argv = [sys.executable, "-m", "sparkple.supervise.supervisor_cli", "status", "--json",
            "--state-dir", str(tmp_path / "state"), "--kmsg", str(tmp_path / "kmsg"),
            "--table-dir", str(table_dir)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_status_reports_memavailable_and_the_tables_state(tmp_path: Path, lab_data) -> None:
    table = tmp_path / "table"
    shutil.copytree(lab_data["table"], table)
    meta = read_meta(table)
    rep = status(tmp_path, table)
    assert rep["table"] == {"state": "published", "data_bytes": meta.data_bytes}
    total = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    assert 0 < rep["mem_available_bytes"] <= total

    with open(meta.data_path(table), "r+b") as data:  # a data file cut short
        data.truncate(meta.data_bytes - 1)
    broken = status(tmp_path, table)["table"]
    assert broken["state"] == "broken"
    assert broken["error"].endswith("rebuild with build-table --force"), broken

    missing = status(tmp_path, tmp_path / "no-table")["table"]
    assert missing["state"] == "missing"
    assert "no table is published in" in missing["error"]
