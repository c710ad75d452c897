"""Tests run Triton kernels in its CPU interpreter unless a GPU is present (then compiled kernels run on CUDA).

The switch must happen before triton is first imported: Triton picks interpreted or compiled at decoration
time. Set TRITON_INTERPRET=1 yourself to force the interpreter on a GPU machine.

Tests marked `slow` take seconds to minutes on 2 CPU cores, mostly Triton's interpreter; a plain `pytest`
leaves them out (pyproject.toml's addopts) and CI runs them. With a GPU they run compiled and quickly, and the
GPU run is the one that checks them compiled, so there the default selection takes them too.
"""

from __future__ import annotations

import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_configure(config: pytest.Config) -> None:
    if torch.cuda.is_available() and config.option.markexpr == "not slow":
        config.option.markexpr = ""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--report-dir", default=None, metavar="DIR",
                     help="append each test's outcome and time to DIR/durations.txt and each failure's report to "
                          "DIR/failures.txt as it happens, so a run stopped at a time limit still says what failed "
                          "(scripts/gpu_tests.sh)")


_REPORT_DIR: dict[str, str] = {}
"""Where --report-dir writes; set in the controlling process only (pytest-xdist's workers forward their reports
to it), so each report is written once."""


def pytest_sessionstart(session: pytest.Session) -> None:
    directory = session.config.getoption("--report-dir")
    if directory is not None and not hasattr(session.config, "workerinput"):
        os.makedirs(directory, exist_ok=True)
        _REPORT_DIR["dir"] = directory


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    directory = _REPORT_DIR.get("dir")
    if directory is None:
        return
    with open(os.path.join(directory, "durations.txt"), "a") as f:
        f.write(f"{report.duration:.2f} {report.when} {report.outcome} {report.nodeid}\n")
    if report.failed:
        with open(os.path.join(directory, "failures.txt"), "a") as f:
            f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext[-8000:]}\n")
