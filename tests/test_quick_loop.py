"""The quick loop (`pytest -m "not slow"`) starts no process: tests/conftest.py makes any test not marked slow fail
when it starts one (but for the converter's watchdog), so a renamed or new test cannot slip a process into it."""

import os
import subprocess
import sys

import pytest


def test_a_test_not_marked_slow_cannot_start_a_process():
    refused = "test_a_test_not_marked_slow_cannot_start_a_process starts a process: mark it slow"
    with pytest.raises(AssertionError, match=refused):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(AssertionError, match=refused):
        os.fork()


def test_the_converters_watchdog_is_the_one_process_allowed(tmp_path):
    from scalevec.convert.staging import StagedFolder

    with StagedFolder(tmp_path / "out") as staged:
        (staged.path / "file").write_text("x")
        staged.commit()
    assert (tmp_path / "out" / "file").read_text() == "x"
