import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # spawned workers import test modules by name

from dist_harness import Pools  # noqa: E402


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()
