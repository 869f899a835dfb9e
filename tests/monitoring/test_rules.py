"""The fleet's alert and recording rules (files/prometheus/sparkple.rules.yml) under `promtool
test rules`: series in, alerts out. Each alert fires on its condition, after its `for`, and
stays quiet just short of it (the host beside it in the same test).

The cases below are the test: this module writes them as promtool's test file, with each
expected alert's description taken from the rules (descriptions are plain text) and its summary
written out here (summaries are templates, so the test checks what they render to).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "files" / "prometheus" / "sparkple.rules.yml"
GIB = 1024**3


def rules() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}


def selector(name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def series(name: str, values: str, **labels: str) -> dict[str, str]:
    return {"series": selector(name, labels), "values": values}


# (alert, input series, eval time, [(labels of each firing alert, its rendered summary)])
CASES: list[tuple[str, list[dict[str, str]], str, list[tuple[dict[str, str], str]]]] = [
    (
        "SparkpleMemoryEmergencyNear",
        [
            series("sparkple_mem_available_bytes", f"{10 * GIB - 2**20}x5", host="a"),
            series("sparkple_mem_available_bytes", f"{10 * GIB}x5", host="b"),
        ],
        "2m",
        [
            (
                {"host": "a"},
                "a: MemAvailable is 9.999GiB, below 10 GiB; the host hangs if it runs out",
            )
        ],
    ),
    # not yet: the condition holds for less than the rule's `for: 1m`
    (
        "SparkpleMemoryEmergencyNear",
        [series("sparkple_mem_available_bytes", f"{10 * GIB} {4 * GIB}x3", host="a")],
        "1m30s",
        [],
    ),
    (
        "SparkpleEngineDown",
        [
            series("up", "0x5", host="a", job="spark-vllm"),
            # stopped on purpose: quiet
            series("up", "0x5", host="b", job="spark-vllm"),
            series("sparkple_supervisor_manual_stop", "1x5", host="b"),
            series("up", "1x5", host="c", job="spark-vllm"),
            # a node exporter that is down is not the engine
            series("up", "0x5", host="c", job="spark-node"),
        ],
        "3m",
        [
            (
                {"host": "a", "job": "spark-vllm"},
                "a: the vLLM server does not answer /metrics and was not stopped on purpose",
            )
        ],
    ),
    (
        "SparkpleEngineCongested",
        [
            # a: one request running, no token for ten minutes
            series("vllm:num_requests_running", "1x12", host="a"),
            series("vllm:num_requests_waiting", "0x12", host="a"),
            series("vllm:generation_tokens_total", "100x12", host="a"),
            # b: busy and generating one token a minute (just enough to be quiet)
            series("vllm:num_requests_running", "1x12", host="b"),
            series("vllm:num_requests_waiting", "2x12", host="b"),
            series("vllm:generation_tokens_total", "100+1x12", host="b"),
            # c: idle and generating nothing
            series("vllm:num_requests_running", "0x12", host="c"),
            series("vllm:num_requests_waiting", "0x12", host="c"),
            series("vllm:generation_tokens_total", "100x12", host="c"),
        ],
        "11m",
        [
            (
                {"host": "a"},
                "a: 1 requests are running or waiting and no token was generated for 5 minutes",
            )
        ],
    ),
    (
        "SparkpleSupervisorHolds",
        [
            series("sparkple_supervisor_state", "1", host="a", state="breaker-open"),
            series("sparkple_supervisor_state", "0", host="a", state="running"),
            series("sparkple_supervisor_state", "1", host="b", state="hold"),
            series("sparkple_supervisor_state", "0", host="c", state="breaker-open"),
            series("sparkple_supervisor_state", "1", host="c", state="backoff"),
        ],
        "0m",
        [
            (
                {"host": "a", "state": "breaker-open"},
                "a: the supervisor is in breaker-open and relaunches nothing",
            ),
            ({"host": "b", "state": "hold"}, "b: the supervisor is in hold and relaunches nothing"),
        ],
    ),
    (
        "SparkpleKernelMemoryErrors",
        [
            series("sparkple_kernel_errors", "2", host="a", kind="nv_err_no_memory"),
            series("sparkple_kernel_errors", "0", host="a", kind="xid"),
            series("sparkple_kernel_errors", "0", host="b", kind="nv_err_no_memory"),
            # the table's device is the other alert's
            series("sparkple_kernel_errors", "3", host="c", kind="table_io"),
        ],
        "0m",
        [
            (
                {"host": "a", "kind": "nv_err_no_memory"},
                "a: 2 NVIDIA driver nv_err_no_memory lines in the kernel log",
            )
        ],
    ),
    (
        "SparkpleTableReadErrors",
        [
            series("sparkple_kernel_errors", "1", host="a", kind="table_io"),
            series("sparkple_kernel_errors", "0", host="b", kind="table_io"),
            series("sparkple_kernel_errors", "5", host="b", kind="xid"),
        ],
        "0m",
        [
            (
                {"host": "a", "kind": "table_io"},
                "a: 1 kernel I/O errors on the PLE table's device",
            )
        ],
    ),
    (
        "SparkplePLEHostDeviceMismatch",
        [
            series("sparkple_ple_host_device_mismatch_total", "0 0 0 1 1 1", host="a"),
            series("sparkple_ple_host_device_mismatch_total", "0x5", host="b"),
        ],
        "5m",
        [
            (
                {"host": "a"},
                "a: the PLE host step's prompt tokens differed from the device's (1 in 15m)",
            )
        ],
    ),
    (
        "SparkpleTableNotPublished",
        [
            series("sparkple_ple_table_published", "0x8", host="a"),
            series("sparkple_ple_table_published", "1x8", host="b"),
        ],
        "6m",
        [
            (
                {"host": "a"},
                "a: no valid packed PLE table is published; the server cannot start",
            )
        ],
    ),
    (
        "SparkpleTableMostlyEvicted",
        [
            series("sparkple_ple_table_resident_ratio", "0.04x25", host="a"),
            series("vllm:generation_tokens_total", "0+60x25", host="a"),
            # at the threshold: quiet
            series("sparkple_ple_table_resident_ratio", "0.05x25", host="b"),
            series("vllm:generation_tokens_total", "0+60x25", host="b"),
            # evicted but not serving: quiet
            series("sparkple_ple_table_resident_ratio", "0.01x25", host="c"),
            series("vllm:generation_tokens_total", "0x25", host="c"),
        ],
        "22m",
        [
            (
                {"host": "a"},
                "a: only 4% of the PLE table is in the page cache while serving",
            )
        ],
    ),
    (
        "SparkpleDiskBytesPerTokenHigh",
        [
            # one token a second on both; a reads one byte a token more than 4 x 64 KiB
            series("vllm:generation_tokens_total", "0+60x25", host="a"),
            series(
                "sparkple_ple_disk_read_bytes_total",
                f"0+{60 * 262145}x25",
                host="a",
                device="nvme0n1",
            ),
            series("vllm:generation_tokens_total", "0+60x25", host="b"),
            series(
                "sparkple_ple_disk_read_bytes_total",
                f"0+{60 * 262144}x25",
                host="b",
                device="nvme0n1",
            ),
        ],
        "22m",
        [
            (
                {"host": "a"},
                "a: 256kiB read from disk per generated token, over 4x the page floor",
            )
        ],
    ),
    (
        "SparkpleRolloutInProgress",
        [
            series("sparkple_supervisor_manual_stop", "1", host="a"),
            series("sparkple_supervisor_manual_stop", "0", host="b"),
        ],
        "0m",
        [
            (
                {"host": "a"},
                "a: the supervisor is paused (a rollout or a stop on purpose)",
            )
        ],
    ),
]

# A pair's link, as a pair node's `ple_metrics` and the scrape's `pair` label give it.
MIB = 2**20
HCA, IFACE = "rocep1s0f1", "enp1s0f1np1"


def link_node(host: str, pair: str, *, ip: str, rdma: str) -> list[dict[str, str]]:
    """One pair node's link bytes, each direction moving as `ip` and `rdma` say."""
    return [
        series(name, values, host=host, pair=pair, direction=d, **labels)
        for d in ("receive", "transmit")
        for name, values, labels in (
            ("sparkple_pair_link_ip_bytes_total", ip, {"interface": IFACE}),
            ("sparkple_pair_link_rdma_bytes_total", rdma, {"device": HCA, "port": "1"}),
        )
    ]


ON_TCP = [
    # p1: serving, 3 MiB/min of IP each way on both nodes, RDMA flat: on TCP
    *link_node("a", "p1", ip=f"0+{3 * MIB}x25", rdma="0x25"),
    *link_node("b", "p1", ip=f"0+{3 * MIB}x25", rdma="0x25"),
    series("vllm:generation_tokens_total", "0+60x25", host="a", pair="p1"),
    # p2: the same IP traffic (vLLM's step broadcast) and RDMA moving: on RDMA, quiet
    *link_node("c", "p2", ip=f"0+{3 * MIB}x25", rdma=f"0+{100 * MIB}x25"),
    *link_node("d", "p2", ip=f"0+{3 * MIB}x25", rdma=f"0+{100 * MIB}x25"),
    series("vllm:generation_tokens_total", "0+60x25", host="c", pair="p2"),
    # p3: on TCP but generating nothing: quiet (nothing to slow down)
    *link_node("e", "p3", ip=f"0+{3 * MIB}x25", rdma="0x25"),
    *link_node("f", "p3", ip=f"0+{3 * MIB}x25", rdma="0x25"),
    series("vllm:generation_tokens_total", "100x25", host="e", pair="p3"),
    # p4: RDMA just over the floor (2 x 64 KiB/min, 1.25 MiB in 10 min): quiet
    *link_node("g", "p4", ip=f"0+{3 * MIB}x25", rdma="0+65536x25"),
    *link_node("h", "p4", ip=f"0+{3 * MIB}x25", rdma="0+65536x25"),
    series("vllm:generation_tokens_total", "0+60x25", host="g", pair="p4"),
]
ON_TCP_SUMMARY = "{}: pair p1 serves with 60MiB of IP and no RDMA bytes on its link in 10 min"
PORT = {"device": HCA, "port": "1"}

CASES += [
    (
        "SparkplePairLinkOnTcp",
        ON_TCP,
        "20m",
        [({"host": h, "pair": "p1"}, ON_TCP_SUMMARY.format(h)) for h in ("a", "b")],
    ),
    # not yet: pending from the first minute, `for: 5m`
    ("SparkplePairLinkOnTcp", ON_TCP, "5m", []),
    (
        "SparkplePairLinkDown",
        [
            # a: the port drops out of ACTIVE (and the interface with it: one alert)
            series("sparkple_pair_link_rdma_port_active", "1 1 0 0 0 0", host="a", **PORT),
            series("sparkple_pair_link_interface_up", "1 1 0 0 0 0", host="a", interface=IFACE),
            # b: the link went down and came back
            series("sparkple_pair_link_rdma_port_active", "1x5", host="b", **PORT),
            series("sparkple_pair_link_rdma_link_downed_total", "0 0 1 1 1 1", host="b", **PORT),
            # c: no RDMA device (the lab), the interface down
            series("sparkple_pair_link_interface_up", "0x5", host="c", interface=IFACE),
            # d: healthy, with link downs counted long ago
            series("sparkple_pair_link_rdma_port_active", "1x5", host="d", **PORT),
            series("sparkple_pair_link_rdma_link_downed_total", "5x5", host="d", **PORT),
            series("sparkple_pair_link_interface_up", "1x5", host="d", interface=IFACE),
            # e: down for less than `for: 1m`
            series("sparkple_pair_link_rdma_port_active", "1 1 1 1 1 0", host="e", **PORT),
        ],
        "5m",
        [
            (
                {"host": "a", **PORT},
                f"a: the pair link ({HCA}) is down or went down in the last 15 min",
            ),
            (
                {"host": "b", **PORT},
                f"b: the pair link ({HCA}) is down or went down in the last 15 min",
            ),
            (
                {"host": "c", "interface": IFACE},
                f"c: the pair link ({IFACE}) is down or went down in the last 15 min",
            ),
        ],
    ),
    (
        "SparkplePairLinkErrors",
        [
            series(
                "sparkple_pair_link_rdma_errors_total",
                "0 0 0 3 3 3 3 3 3 3 3",
                host="a",
                pair="p1",
                counter="symbol_error",
                **PORT,
            ),
            series(
                "sparkple_pair_link_rdma_errors_total",
                "7x10",
                host="b",
                pair="p1",
                counter="out_of_sequence",
                **PORT,
            ),
            # what a peer that dies also raises: left out
            series(
                "sparkple_pair_link_rdma_errors_total",
                "0 0 0 9 9 9 9 9 9 9 9",
                host="b",
                pair="p1",
                counter="local_ack_timeout_err",
                **PORT,
            ),
        ],
        "10m",
        [
            (
                {"host": "a", "pair": "p1", "counter": "symbol_error", **PORT},
                f"a: 3 symbol_error on the pair link's port {HCA}/1 in 15 min",
            )
        ],
    ),
]

# recording rules whose value is exact for a known input
RECORDED = [
    (
        [
            series("vllm:generation_tokens_total", "0+60x10", host="a", instance="a:8000"),
            series(
                "sparkple_ple_disk_read_bytes_total", "0+3932160x10", host="a", device="nvme0n1"
            ),
        ],
        "10m",
        "host:sparkple_ple_disk_bytes_per_token:ratio5m",
        [({"host": "a"}, 65536)],
    ),
    (
        [
            series("vllm:num_requests_running", "3", host="a", engine="0"),
            series("vllm:num_requests_running", "1", host="a", engine="1"),
        ],
        "0m",
        "host:vllm_requests_running:sum",
        [({"host": "a"}, 4)],
    ),
]


def promtool_tests() -> dict[str, Any]:
    known = rules()
    tests = []
    for alert, inputs, at, firing in CASES:
        rule = known[alert]
        assert "{{" not in rule["annotations"]["description"], f"{alert}: plain description"
        expected = [
            {
                "exp_labels": {**labels, **rule.get("labels", {})},
                "exp_annotations": {
                    "summary": summary,
                    "description": rule["annotations"]["description"],
                },
            }
            for labels, summary in firing
        ]
        tests.append(
            {
                "interval": "1m",
                "input_series": inputs,
                "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": expected}],
            }
        )
    for inputs, at, expr, samples in RECORDED:
        tests.append(
            {
                "interval": "1m",
                "input_series": inputs,
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": at,
                        "exp_samples": [
                            {"labels": selector(expr, lb), "value": v} for lb, v in samples
                        ],
                    }
                ],
            }
        )
    return {"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": tests}


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool not installed (apt-get install prometheus; .ci/setup-system does it)")
    return found


def run_promtool(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120)


def test_rules_pass_promtool_check(promtool: str) -> None:
    checked = run_promtool(promtool, "check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_alert_is_tested_and_says_what_to_do() -> None:
    known = rules()
    assert {case[0] for case in CASES} == set(known), "one promtool case (at least) per alert"
    for name, rule in known.items():
        notes = rule["annotations"]
        assert set(notes) == {"summary", "description"}, name
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        # the description names a command or a playbook docs/operations.md uses
        assert (
            any(
                word in notes["description"]
                for word in ("sparkple-ops", "playbooks/", "site.yml", "dmesg", "sparkple ")
            )
            or "read_ahead_kb" in notes["description"]
        ), f"{name}: say what to do"


def test_alerts_fire_on_their_condition_and_not_below(promtool: str, tmp_path: Path) -> None:
    spec = tmp_path / "sparkple.rules.test.yml"
    spec.write_text(yaml.safe_dump(promtool_tests(), sort_keys=False))
    result = run_promtool(promtool, "test", "rules", str(spec))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_a_wrong_expectation_fails(promtool: str, tmp_path: Path) -> None:
    """The harness itself can fail: the same tests with one quiet host expected to fire."""
    doc = promtool_tests()
    first = doc["tests"][0]["alert_rule_test"][0]
    extra = dict(first["exp_alerts"][0])
    extra["exp_labels"] = {**extra["exp_labels"], "host": "b"}
    first["exp_alerts"].append(extra)
    spec = tmp_path / "wrong.test.yml"
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    result = run_promtool(promtool, "test", "rules", str(spec))
    assert result.returncode != 0
    assert "SparkpleMemoryEmergencyNear" in result.stdout + result.stderr
