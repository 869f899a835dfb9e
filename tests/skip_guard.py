"""No silent passes: under CI=true a test that checked nothing fails the run.

A test that skips because a part is missing (the vLLM wheel, torch, promtool, docker, a real
disk) proves nothing, so in CI it must not pass as a skip. Under CI=true:
- a skipped test fails, unless it is marked `gpu` and skipped with exactly `NO_CUDA` (CI has
  no GPU; `make gpu-check` runs them where one is): `skip_without_cuda()` is that skip; with
  SPARKPLE_CUDA_REQUIRED=1 (the GPU check sets it) a gpu test's skip fails too;
- an imperative `pytest.xfail(...)` fails (it passes without checking anything, like a skip),
  and so does an xfail-marked test that passes (strict or not: the mark is stale).
Always: a collection warning (a test class pytest cannot collect, e.g. one with an __init__,
whose tests would silently never run) fails its collector, whatever -W or filterwarnings say.
Loaded by tests/conftest.py; a developer machine without CI=true still skips, and .ci/test
prints the skips in its closing line.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Generator
from typing import Any

import pytest

# The one reason a `gpu`-marked test may skip under CI=true.
NO_CUDA = "no CUDA device"


def enforced() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def skip_without_cuda() -> Any:
    """torch, in a `gpu` test; skips with NO_CUDA where torch sees no CUDA device.

    torch itself missing is a skip for another reason, so under CI=true it fails the test.
    """
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    return torch


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr: Any = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def fail(report: pytest.TestReport | pytest.CollectReport, message: str) -> None:
    report.outcome = "failed"
    report.longrepr = message
    if hasattr(report, "wasxfail"):
        del report.wasxfail  # else the reporters and JUnit still count it as an xfail


def refuse(report: pytest.TestReport | pytest.CollectReport, nodeid: str, gpu: bool) -> None:
    reason = skip_reason(report)
    if gpu and cuda_required():
        fail(
            report,
            f"{nodeid} is gpu-marked and was skipped in the GPU check ({reason}), which runs "
            "only on a machine with a CUDA device: it checked nothing there",
        )
        return
    if gpu:
        fail(
            report,
            f"{nodeid} is gpu-marked and was skipped under CI=true for another reason than "
            f"{NO_CUDA!r} ({reason}): a gpu test may skip in CI only for want of a CUDA device "
            "(skip_guard.skip_without_cuda()); install what else it needs (.ci/setup-venv) or "
            "check for it only after the CUDA check",
        )
        return
    fail(
        report,
        f"{nodeid} was skipped under CI=true ({reason}); only `gpu`-marked "
        "tests may skip in CI: install what the test needs (.ci/setup-system, .ci/setup-venv) "
        "or mark it gpu if it needs a GPU",
    )


# Set by the GPU check (gpu/gpu-check.sh), which runs only where there is a CUDA device: a
# gpu test that skips there, for want of one or not, has checked nothing.
CUDA_REQUIRED_ENV = "SPARKPLE_CUDA_REQUIRED"


def cuda_required() -> bool:
    return os.environ.get(CUDA_REQUIRED_ENV, "") == "1"


def may_skip(node: pytest.Item | pytest.Collector, report: Any) -> bool:
    gpu_no_cuda = node.get_closest_marker("gpu") is not None and skip_reason(report) == NO_CUDA
    return gpu_no_cuda and not cuda_required()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not enforced():
        return
    marked_xfail = item.get_closest_marker("xfail") is not None
    if hasattr(report, "wasxfail"):
        if report.skipped and not marked_xfail:
            fail(
                report,
                f"{item.nodeid} called pytest.xfail under CI=true ({report.wasxfail}): that "
                "passes without checking anything; install what the test needs, or mark a "
                "known bug @pytest.mark.xfail(reason=..., strict=True)",
            )
        elif report.passed:
            fail(
                report,
                f"{item.nodeid} is marked xfail ({report.wasxfail}) but passed under CI=true: "
                "the mark is stale or the test checks nothing; remove the mark or fix the test",
            )
    elif report.skipped and not may_skip(item, report):
        refuse(report, item.nodeid, item.get_closest_marker("gpu") is not None)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    """A whole module skipped at import (pytest.importorskip at its top) fails too, under
    CI=true; a collection warning (a test class or function pytest will not run) always."""
    with warnings.catch_warnings(record=True) as caught:
        # innermost filter: recorded here whatever -W, -p no:warnings or filterwarnings say
        warnings.simplefilter("always", pytest.PytestCollectionWarning)
        outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    unrun = [w for w in caught if issubclass(w.category, pytest.PytestCollectionWarning)]
    for w in caught:  # the others go on to pytest's own warning capture, as before
        if w not in unrun:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    if unrun and not report.failed:
        said = "; ".join(f"{w.filename}:{w.lineno}: {w.message}" for w in unrun)
        fail(
            report,
            f"{collector.nodeid}: pytest would silently not run these tests ({said}): fix "
            "what the warning names (a test class must have no __init__ or __new__: set its "
            "state in a fixture or setup_method)",
        )
    elif enforced() and report.skipped and not may_skip(collector, report):
        refuse(report, collector.nodeid, collector.get_closest_marker("gpu") is not None)
