"""One live run per output folder: a second `scalevec-train` on a folder that a running one holds is refused at
once, instead of both writing into it; a run that ends, however it ends, lets the next one in at once."""

import contextlib
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = ".scalevec-train.lock"
_HELD: set[int] = set()  # the descriptors through which this process holds a lock


def _release_in_forked_child() -> None:
    # A forked child (a DataLoader worker) shares the lock through its copy of the descriptor, and would hold it
    # after the run is killed, until it notices: it closes its copy, so that the lock ends with the run's process.
    for descriptor in _HELD:
        with contextlib.suppress(OSError):
            os.close(descriptor)
    _HELD.clear()


os.register_at_fork(after_in_child=_release_in_forked_child)


@contextmanager
def holding_output_dir(output_dir: Path, take: bool = True) -> Iterator[None]:
    """Hold `output_dir` for the block (where `take`: the main process of a multi-process run). An exclusive
    `flock` on a file in the folder, which the kernel drops when the process ends, however it ends: a killed run
    leaves the file but no lock. Its descriptor is not inherited (closed on exec, and closed in a forked child), so
    no worker process keeps the lock after it. A run that ends removes the file while it still holds the lock
    (where it can)."""
    if not take:
        yield
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / LOCK_NAME
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 32, 0).decode(errors="replace").strip() or "?"
            raise ValueError(
                f"--output-dir {output_dir} is in use by another scalevec-train run (process {holder}); wait for "
                "it to end, or choose another folder"
            ) from None
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
        _HELD.add(descriptor)
        try:
            yield
        finally:
            _HELD.discard(descriptor)
            # A folder that became unwritable keeps the file: harmless, and the run's own error is the one to tell.
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
    finally:
        os.close(descriptor)
