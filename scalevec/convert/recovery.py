"""Undoing an unfinished output. Standard library only: besides being imported by the converter, this file runs as
the watchdog script (`python -I -S recovery.py ...`), a tiny process that outlives a converter killed with SIGKILL
and cleans up after it."""

import os
import shutil
import sys


def recover(staging: str, backup: str, destination: str, lock: str) -> None:
    """Remove the staging folder; put a backed-up old destination back unless a new one already replaced it.
    Safe to run in any state of a commit, and more than once."""
    shutil.rmtree(staging, ignore_errors=True)
    if os.path.lexists(backup):
        if os.path.lexists(destination):
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.rename(backup, destination)
    if os.path.lexists(lock):
        os.unlink(lock)


if __name__ == "__main__":
    # stdin is a pipe whose other end only the converter holds: end of file means the converter has ended, however.
    sys.stdin.buffer.read()
    recover(*sys.argv[1:5])
