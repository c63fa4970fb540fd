import os

import pytest

# Tiny models: one thread is faster and keeps parallel test workers from oversubscribing 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    # Tests of executed notebooks need `make notebooks` first; everything else is a unit test.
    for item in items:
        if "test_executed_notebooks" in item.nodeid:
            item.add_marker(pytest.mark.notebooks)
