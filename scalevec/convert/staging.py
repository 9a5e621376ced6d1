"""Atomic output folders. Everything is written into a staging folder beside the destination, which is renamed
into place only when the caller commits; until then the destination is untouched (or absent).

- An exception or Ctrl-C removes the staging folder (and restores a destination being overwritten).
- SIGKILL cannot be caught: a watchdog process, started with the staging folder and in a session of its own,
  notices the converter's end through a pipe and does the same cleanup. If both are killed at once (e.g. a whole
  container), the staging folder remains, named `.<destination>.scalevec-convert-<id>.tmp`, with an unlocked lock
  file `.<destination>.scalevec-convert-<id>.lock`; the next conversion into the same parent folder removes it.
- A partial destination can never appear: the destination only ever comes into being by one `rename`, after its
  files were flushed to the disk, and that rename never replaces anything (`rename_noreplace`): a destination that
  appears meanwhile, from another conversion say, is left as it is and this one fails.
- A failed write (no space, a read-only or forbidden folder) is reported as the destination's, not as the name of
  an internal file.
"""

import fcntl
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from ..atomic import describe_os_error, explain_write_failure, finish_tree, fsync_path, rename_noreplace
from . import recovery
from .errors import TargetError

MARK = "scalevec-convert"


class StagedFolder:
    """`with StagedFolder(destination, overwrite) as staged:` write into `staged.path`, then `staged.commit()`."""

    def __init__(self, destination: str | Path, overwrite: bool = False):
        self.destination = Path(destination).absolute()
        self.overwrite = overwrite
        check_destination(self.destination, overwrite)
        self._stem = f".{self.destination.name}.{MARK}-{os.getpid()}-{secrets.token_hex(4)}"
        parent = self.destination.parent
        self.path, self.backup = parent / f"{self._stem}.tmp", parent / f"{self._stem}.old"
        self.lock = parent / f"{self._stem}.lock"
        self._lock_file = self._watchdog = None
        self.committed = False

    def __enter__(self) -> "StagedFolder":
        try:
            self._start()
        except BaseException as error:
            self.__exit__(type(error), error, error.__traceback__)
            raise
        return self

    def _start(self) -> None:
        self.destination.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(self.destination.parent)
        self._lock_file = _locked_file(self.lock)
        self.path.mkdir()
        self._watchdog = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                recovery.__file__,
                *map(str, (self.path, self.backup, self.destination, self.lock)),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # no Ctrl-C for it: it must outlive the converter
        )

    def commit(self) -> None:
        """Move the staging folder into place (replacing an old destination if `overwrite`), durably."""
        check_destination(self.destination, self.overwrite)
        finish_tree(self.path)
        if self.overwrite and self.destination.exists():
            os.rename(self.destination, self.backup)
        try:
            rename_noreplace(self.path, self.destination)
        except FileExistsError:
            raise TargetError(
                f"{self.destination} appeared while this output was being written (another conversion?); it was "
                "left as it is and nothing was written"
            ) from None
        self.committed = True
        fsync_path(self.destination.parent)
        shutil.rmtree(self.backup, ignore_errors=True)

    def __exit__(self, exc_type=None, error=None, traceback=None) -> None:
        recovery.recover(str(self.path), str(self.backup), str(self.destination), str(self.lock))
        if self._lock_file is not None:
            self._lock_file.close()
        if self._watchdog is not None:
            self._watchdog.stdin.close()
            self._watchdog.wait()
        if error is not None:
            self._raise_as_output_error(error)

    def _raise_as_output_error(self, error: BaseException) -> None:
        """A failed write into the staging folder is the destination's failure: say so, with the cause."""
        cause = explain_write_failure(error, self.destination.parent)
        if cause is not None and self._is_ours(cause.filename):
            message = describe_os_error(cause, self.destination)
            raise TargetError(f"cannot write {message}; nothing was written") from error

    def _is_ours(self, filename: str | None) -> bool:
        """Whether a failing path is the output's: the staging files, the destination, or a folder above it."""
        if filename is None:
            return True
        path = Path(filename).absolute()
        staged = path.parent == self.destination.parent and path.name.startswith(self._stem)
        return staged or self.path in path.parents or path == self.destination or path in self.destination.parents


def check_destination(destination: Path, overwrite: bool) -> None:
    if destination.is_file() or destination.is_symlink():
        raise TargetError(f"{destination} exists and is not a folder; choose another destination")
    if destination.exists() and not overwrite:
        raise TargetError(f"{destination} already exists; pass --overwrite (overwrite=True) to replace it")


def _locked_file(path: Path):
    """Create `path` already locked: the lock is taken under a temporary name, so nobody ever sees it unlocked."""
    temporary = path.with_suffix(f".{secrets.token_hex(4)}.new")
    handle = open(temporary, "w")  # noqa: SIM115 (held until the conversion ends)
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(temporary, path)
    return handle


def remove_stale_staging(parent: Path) -> None:
    """Remove what conversions that died with their watchdog left in `parent`: staging folders whose lock file
    nobody holds. An `.old` folder (a destination being replaced) is put back if its destination is missing."""
    for lock in parent.glob(f".*.{MARK}-*.lock"):
        try:
            handle = open(lock)  # noqa: SIM115 (closed below, whichever way)
        except FileNotFoundError:
            continue  # cleaned up meanwhile
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live conversion
            stem = lock.name.removesuffix(".lock")
            destination = parent / stem[1:].rsplit(f".{MARK}-", 1)[0]
            recovery.recover(str(parent / f"{stem}.tmp"), str(parent / f"{stem}.old"), str(destination), str(lock))
