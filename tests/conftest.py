import os
import sys

import pytest
import torch

# One intra-op thread in the test process, as in the ranks: on two cores shared with the ranks (and on a busy
# machine) a second thread only waits for a core, and references computed here then split work as the ranks do.
torch.set_num_threads(1)

sys.path.insert(0, os.path.dirname(__file__))  # workers import test modules by name

from dist_harness import Pools  # noqa: E402

# A test outside the end-to-end tier that runs longer than this is named at the end of the run (never failed:
# a busy machine must give the same verdict); docs/testing.md says how to make it cheap.
SLOW_S = 5.0
_slow: list[tuple[float, str]] = []


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()


def pytest_runtest_logreport(report):
    if report.when == "call" and report.duration > SLOW_S and "e2e" not in report.keywords:
        _slow.append((report.duration, report.nodeid))


def pytest_terminal_summary(terminalreporter):
    if _slow:
        terminalreporter.section(f"tests over {SLOW_S:g} s outside the end-to-end tier (mark e2e, or make cheap)")
        for took, nodeid in sorted(_slow, reverse=True):
            terminalreporter.write_line(f"{took:7.1f}s {nodeid}")
