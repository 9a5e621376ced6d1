"""The staging folder of a preparation, which outlives a killed process so that the next preparation into the same
place continues it (or removes it, when that preparation is of something else).

A preparation of `NAME` works in `.NAME.staging` beside it (beside `--output`, or in the cache folder), holding an
exclusive `flock` on that folder, which the kernel drops however the process ends. It saves its progress there
(`progress.json`, with a key naming what is being prepared) and renames the folder into place when complete. A
second preparation into the same place waits for the first, or is refused, while the first is alive; after a kill
it takes the folder over: it continues from the saved progress if the key is its own, else empties the folder.
"""

import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..atomic import commit_folder, write_text_atomically
from .sources import DataError

PROGRESS = "progress.json"


def staging_folder(destination: Path) -> Path:
    return destination.with_name(f".{destination.name}.staging")


def unfinished_preparation(destination: Path) -> str | None:
    """What a preparation into `destination` that has not finished left beside it, in words; None if nothing."""
    path = staging_folder(destination)
    if not path.is_dir():
        return None
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return f"{destination}: not prepared yet: another process is preparing it now (in {path})"
    finally:
        os.close(descriptor)
    return (
        f"{destination}: not prepared yet: a preparation into it was interrupted, and what it had done is in "
        f"{path}; run the same `scalevec-data prepare ... --output {destination}` again and it continues from there"
    )


class Staging:
    """A held staging folder: `path` to write into, `progress` saved by an earlier try with the same key (or
    None), `save` to save progress, `commit` to rename it into place, `discard` to remove it."""

    def __init__(self, destination: Path, key: str, descriptor: int):
        self.destination, self.key, self.path = destination, key, staging_folder(destination)
        self._descriptor = descriptor
        self.progress = self._saved_progress()

    def _saved_progress(self) -> dict | None:
        try:
            saved = json.loads((self.path / PROGRESS).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            saved = None
        if isinstance(saved, dict) and saved.get("key") == self.key:
            return saved
        for child in self.path.iterdir():  # a killed preparation of something else, or one without progress yet
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        return None

    def save(self, progress: dict) -> None:
        """Record `progress` (the caller flushed what it describes to the disk first)."""
        write_text_atomically(self.path / PROGRESS, json.dumps({**progress, "key": self.key}))

    def commit(self) -> None:
        (self.path / PROGRESS).unlink(missing_ok=True)
        commit_folder(self.path, self.destination)

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


@contextmanager
def staged(destination: Path, key: str, wait: bool) -> Iterator[Staging]:
    """Hold the staging folder of `destination` for the block. With `wait`, a preparation into the same place
    by a live process is waited for; without, it is refused. Either way, a `destination` that exists once the
    folder is held is refused (`DataError`: nothing is overwritten)."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    path = staging_folder(destination)
    descriptor = _hold(path, wait, destination)
    try:
        if destination.exists():
            shutil.rmtree(path, ignore_errors=True)  # made by us just now, or left beside a finished folder
            raise DataError(f"{destination} already exists (nothing is overwritten)")
        for legacy in destination.parent.glob(f".{destination.name}.staging-*"):  # left by earlier versions
            shutil.rmtree(legacy, ignore_errors=True)
        yield Staging(destination, key, descriptor)
    finally:
        os.close(descriptor)


def _hold(path: Path, wait: bool, destination: Path) -> int:
    """A descriptor of the folder `path` (created if missing), locked exclusively."""
    while True:
        path.mkdir(exist_ok=True)
        descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            raise DataError(
                f"{destination} is being prepared by another process (in {path}); wait for it to end"
            ) from None
        try:
            held = os.stat(path)
        except FileNotFoundError:
            held = None
        mine = os.fstat(descriptor)
        if held is not None and (held.st_dev, held.st_ino) == (mine.st_dev, mine.st_ino):
            return descriptor
        os.close(descriptor)  # the folder was renamed into place (or removed) by the process we waited for
