"""The fleet dashboard (files/grafana/sparkple-fleet.json): one row per Spark, every panel's
expression valid PromQL (promtool parses each one as a rule), and every recorded series it reads
defined by the rules. The fleet scenario checks the same expressions against live data."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "files" / "grafana" / "sparkple-fleet.json"
RULES = REPO / "files" / "prometheus" / "sparkple.rules.yml"
# the panels the fleet's operators asked for, by title
WANTED = {
    "Tokens generated /s",
    "Requests running and waiting",
    "Time to first token",
    "MemAvailable and page cache",
    "PLE rows gathered /s",
    "Disk bytes per generated token",
    "Handshake wait p99",
    "Supervisor state",
    "Incidents",
    "Pair link bytes /s",
    "Pair link errors and link downs",
}
LINK_PANELS = {"Pair link bytes /s", "Pair link errors and link downs"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def promtool_or_skip() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus; .ci/setup-system does it)")
    return promtool


def expressions() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def test_one_row_per_spark_with_every_panel() -> None:
    doc = dashboard()
    rows = [p for p in doc["panels"] if p["type"] == "row"]
    assert len(rows) == 1 and rows[0]["repeat"] == "host"
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["host"]["definition"] == "label_values(sparkple_mem_available_bytes, host)"
    assert variables["datasource"]["type"] == "datasource"
    titles = {p["title"] for p in doc["panels"] if p["type"] != "row"}
    assert titles == WANTED
    for expr in expressions():
        assert '{host=~"$host"}' in expr, f"{expr}: every expression is per Spark"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))


def test_recorded_series_it_reads_are_defined() -> None:
    recorded = {
        r["record"]
        for g in yaml.safe_load(RULES.read_text())["groups"]
        for r in g["rules"]
        if "record" in r
    }
    used = {name for e in expressions() for name in re.findall(r"\bhost:[a-z0-9_:]+", e)}
    assert used and used <= recorded, used - recorded


def test_every_expression_is_valid_promql(tmp_path: Path) -> None:
    promtool = promtool_or_skip()
    group = {
        "name": "dashboard",
        "rules": [
            {"record": f"dashboard:panel_{i}", "expr": e.replace("$host", ".+")}
            for i, e in enumerate(expressions())
        ],
    }
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [group]}))
    checked = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # and a broken one is refused, so the check means something
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "x", "rules": [{"record": "a:b", "expr": "sum("}]}]})
    )
    bad = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, timeout=60)
    assert bad.returncode != 0


def test_the_link_panels_answer_for_every_spark(tmp_path: Path) -> None:
    """A pair node's link panels show its rates; a single Spark (and a node without its RDMA
    device) reads 0 rather than no data, so every row's panels answer."""
    promtool = promtool_or_skip()
    targets = {
        (p["title"], t["legendFormat"]): t["expr"].replace("$host", ".+")
        for p in dashboard()["panels"]
        if p["title"] in LINK_PANELS
        for t in p["targets"]
    }
    port = 'device="rocep1s0f1",port="1"'
    inputs = [
        {"series": 'sparkple_mem_available_bytes{host="single"}', "values": "1e10x10"},
        {"series": 'sparkple_mem_available_bytes{host="node"}', "values": "1e10x10"},
    ]
    for direction in ("receive", "transmit"):
        inputs += [
            {
                "series": f'sparkple_pair_link_rdma_bytes_total{{host="node",{port},'
                f'direction="{direction}"}}',
                "values": "0+6000x10",  # 100 B/s
            },
            {
                "series": f'sparkple_pair_link_ip_bytes_total{{host="node",interface="e",'
                f'direction="{direction}"}}',
                "values": "0+600x10",  # 10 B/s
            },
        ]
    inputs += [
        {
            "series": f'sparkple_pair_link_rdma_errors_total{{host="node",{port},'
            'counter="symbol_error"}',
            "values": "0+5x10",
        },
        {"series": f'sparkple_pair_link_rdma_link_downed_total{{host="node",{port}}}',
         "values": "1x10"},
    ]  # fmt: skip
    node = {
        ("Pair link bytes /s", "RDMA"): 200,
        ("Pair link bytes /s", "IP"): 20,
        ("Pair link errors and link downs", "errors /5m"): 25,
        ("Pair link errors and link downs", "link downs /5m"): 0,
    }
    assert set(targets) == set(node)
    tests = [
        {
            "expr": expr,
            "eval_time": "10m",
            "exp_samples": [
                {"labels": '{host="node"}', "value": node[key]},
                {"labels": '{host="single"}', "value": 0},
            ],
        }
        for key, expr in targets.items()
    ]
    spec = tmp_path / "link.test.yml"
    spec.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(RULES)],
                "evaluation_interval": "1m",
                "tests": [{"interval": "1m", "input_series": inputs, "promql_expr_test": tests}],
            }
        )
    )
    result = subprocess.run(
        [promtool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
