import os

import pytest
from hypothesis import settings

# Tiny models: one thread is faster and keeps parallel test workers from oversubscribing 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Property tests (test_properties.py) draw the same examples on every run: a failure can be
# rerun as is, and a pass does not depend on which examples happened to be drawn. Each test
# keeps its own max_examples and deadline; derandomize=True also turns off the example database.
settings.register_profile("deterministic", derandomize=True)
settings.load_profile("deterministic")


def pytest_collection_modifyitems(config, items):
    # Tests of executed notebooks need `make notebooks` first; everything else is a unit test.
    for item in items:
        if "test_executed_notebooks" in item.nodeid:
            item.add_marker(pytest.mark.notebooks)
    # The slow tests (real processes, 8-80 s each here) are queued first, in their usual order. Under
    # `--dist worksteal` (make unit, make pythons) one worker gets them all and the other, once idle, takes
    # the tail of its queue, so none starts near the end. xdist's default load scheduling would hand them
    # all to one worker in its first chunk and never move them: use worksteal wherever this order applies.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
