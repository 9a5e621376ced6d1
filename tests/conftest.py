import os
import subprocess

import pytest
import torch

from scalevec.convert import recovery

from .hub_server import HubServer

# Tests that start processes (torchrun, the CLIs or a fresh interpreter in a subprocess, preparation shards, a C++
# compiler) or train whole grids end to end are marked `slow` where they live: `pytestmark = pytest.mark.slow` in a
# file whose every test (or a fixture they share) does so, `@pytest.mark.slow` on a single test. `pytest -m "not
# slow"` is the quick loop, plain `pytest` runs everything; a test not marked slow that starts a process fails
# (`_unmarked_tests_start_no_process`), so the quick loop cannot grow one by a rename.


def _marked_slow_in_file(item: pytest.Item) -> bool:
    marks = getattr(item.module, "pytestmark", [])
    return any(mark.name == "slow" for mark in (marks if isinstance(marks, list) else [marks]))


def pytest_collection_modifyitems(config, items):
    # The slow files first: pytest-xdist hands out files in this order, so the quick ones fill the end of the run
    # instead of one worker finishing a long file alone.
    items.sort(key=lambda item: not _marked_slow_in_file(item))


@pytest.fixture(autouse=True)
def _unmarked_tests_start_no_process(request, monkeypatch):
    if request.node.get_closest_marker("slow") is not None:
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it slow (see tests/conftest.py)")

    start_child = subprocess.Popen._execute_child

    def watchdog_only(popen, args, *rest, **kwargs):
        # The one process a quick test may start: the converter's watchdog of its staging folder (a bare
        # interpreter, -I -S, that waits on a pipe), which is part of every conversion the tests check.
        if recovery.__file__ not in map(str, args):
            refuse()
        return start_child(popen, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", watchdog_only)
    for name in ("fork", "posix_spawn", "posix_spawnp"):
        monkeypatch.setattr(os, name, refuse)


@pytest.fixture
def hub():
    """A fresh Hub-protocol server on loopback (see `tests/hub_server.py`); `hub.env(tmp_path / "hf_home", token)`
    is the environment for a subprocess that uses it."""
    server = HubServer().start()
    yield server
    server.stop()


@pytest.fixture(autouse=True, scope="session")
def single_torch_thread():
    """Tiny models on a shared 2-core machine: with two threads each tiny op waits for a busy core (up to 100x
    slower). Subprocesses set OMP_NUM_THREADS themselves."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
