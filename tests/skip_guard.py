"""No silent skips: under CI=true a skipped test fails the run unless it is marked `gpu`.

A test that skips because a part is missing (the vLLM wheel, torch, promtool, docker, a real
disk) proves nothing, so in CI it must not pass as a skip. Only `gpu` tests may skip there (CI
has no GPU; `make gpu-check` runs them where one is). Loaded by tests/conftest.py; a developer
machine without CI=true still skips, and .ci/test prints the skips in its closing line.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest


def enforced() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr: Any = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def refuse(report: pytest.TestReport | pytest.CollectReport, nodeid: str) -> None:
    report.outcome = "failed"
    report.longrepr = (
        f"{nodeid} was skipped under CI=true ({skip_reason(report)}); only `gpu`-marked "
        "tests may skip in CI: install what the test needs (.ci/setup-system, .ci/setup-venv) "
        "or mark it gpu if it needs a GPU"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if (
        enforced()
        and report.skipped
        and not hasattr(report, "wasxfail")
        and item.get_closest_marker("gpu") is None
    ):
        refuse(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    """A whole module skipped at import (pytest.importorskip at its top) fails too."""
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if enforced() and report.skipped and collector.get_closest_marker("gpu") is None:
        refuse(report, collector.nodeid)
