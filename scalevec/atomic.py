"""Atomic files and folders: a reader (or a crash, or a power loss) sees the old one or the new one, never half of
one. Also the one place that turns the OS errors a user can cause into a sentence naming the path."""

import ctypes
import errno
import fcntl
import io
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError
from tqdm import tqdm

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1  # from linux/fs.h
_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP)
_CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOENT: "no such file or folder",
    errno.ENOTDIR: "a part of the path is not a folder",
    errno.EEXIST: "already exists",
    errno.EIO: "input/output error",
}
# A failed write with less free space than this is taken for a full disk (see `explain_write_failure`).
_NEARLY_FULL = 1 << 20


def write_text_atomically(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to a temporary file beside `path`, then rename it onto `path`."""
    return write_bytes_atomically(path, text.encode("utf-8"))


def write_bytes_atomically(path: str | Path, data: bytes) -> Path:
    """Write `data` to a temporary file of its own beside `path` (processes writing `path` at once never share
    one), then rename it onto `path`: the last rename wins, whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        os.chmod(temporary, user_mode(is_folder=False))  # mkstemp makes it private
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def write_figure_atomically(fig, path: str | Path) -> Path:
    """Write a matplotlib figure as PNG atomically (a reader never sees half a file, and processes drawing the same
    figure at once, as the shards of a study do, do not clash) and close it."""
    import matplotlib.pyplot as plt

    image = io.BytesIO()
    fig.savefig(image, dpi=110, format="png")
    plt.close(fig)
    return write_bytes_atomically(path, image.getvalue())


def fsync_path(path: str | Path) -> None:
    """Flush a file's data, or a folder's entries, to the disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def user_mode(is_folder: bool) -> int:
    """The permissions `open` gives a new file (`mkdir` a new folder) under the process's umask: 0644 (0755)
    under the usual umask 022, 0664 (0775) under a team's 002."""
    return (0o777 if is_folder else 0o666) & ~_umask()


def _umask() -> int:
    try:  # Linux says it without changing it, which setting and restoring it would, for every thread
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"^Umask:\s*([0-7]+)", status, re.MULTILINE).group(1), 8)
    except (OSError, AttributeError):
        umask = os.umask(0o022)
        os.umask(umask)
        return umask


def finish_tree(folder: str | Path) -> None:
    """Make the staged `folder` ready to appear under its final name: every file and folder under it, and it, get
    the user's permissions (`user_mode`: `mkdtemp`, `mkstemp` and safetensors make them private, so that a job
    running as another user, or a colleague, could not read them) and are flushed to the disk (after a power loss a
    folder renamed into place afterwards holds what was written, not empty files)."""
    file_mode, folder_mode = user_mode(is_folder=False), user_mode(is_folder=True)
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, file_mode)
                fsync_path(path)
        os.chmod(root, folder_mode)
        fsync_path(root)


def rename_noreplace(source: str | Path, destination: str | Path) -> None:
    """Rename `source` to `destination`, failing with `FileExistsError` if `destination` exists, in one step:
    `renameat2(RENAME_NOREPLACE)` where the kernel and the file system have it; elsewhere an exclusive lock on the
    parent folder, which every caller takes, is held across the check and the rename."""
    if _renameat2_noreplace(os.fsencode(source), os.fsencode(destination)):
        return
    parent = os.open(os.path.dirname(os.path.abspath(destination)), os.O_RDONLY)
    try:
        fcntl.flock(parent, fcntl.LOCK_EX)
        if os.path.lexists(destination):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(destination))
        os.rename(source, destination)
    finally:
        os.close(parent)  # releases the lock


def _renameat2_noreplace(source: bytes, destination: bytes) -> bool:
    """True when renamed; False when this system cannot rename without replacing (then nothing happened)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28, or not Linux
        return False
    if renameat2(_AT_FDCWD, source, _AT_FDCWD, destination, _RENAME_NOREPLACE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:  # a real error (a folder into itself, say) comes back from the fallback's rename
        return False
    raise OSError(code, os.strerror(code), os.fsdecode(source), None, os.fsdecode(destination))


def commit_folder(staging: str | Path, destination: str | Path) -> None:
    """Make the finished folder `staging` appear as `destination` (which must not exist), durably and with the
    user's permissions (`finish_tree`); the parent's entry is flushed after the rename."""
    finish_tree(staging)
    rename_noreplace(staging, destination)
    fsync_path(os.path.dirname(os.path.abspath(destination)))


def remove_folder(folder: str | Path) -> None:
    """Delete `folder` so that no half-deleted copy can be mistaken for it: rename it to a hidden name first."""
    folder = Path(folder)
    doomed = folder.with_name(f".{folder.name}.deleting")
    shutil.rmtree(doomed, ignore_errors=True)  # left by a process killed while deleting
    os.rename(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def exit_status(program: str, work: Callable[[], object], expected: tuple[type[Exception], ...]) -> int:
    """Run a command-line program's `work`: 0 when it succeeds; 1 after one line `program: error: ...` when it
    raises one of `expected` or an `OSError` (then the path and the cause, as `describe_os_error` words them)."""
    try:
        work()
    except expected as error:
        message = str(error)
    except OSError as error:
        message = describe_os_error(error)
    else:
        return 0
    for bar in list(tqdm._instances):  # a progress bar the error interrupted: end its line, or ours would join it
        bar.close()
    print(f"{program}: error: {message}", file=sys.stderr)
    return 1


def describe_os_error(error: OSError, path: str | Path | None = None) -> str:
    """One line naming the path and the cause: `<path>: no space left on the device`. `path` replaces the file
    the error names (e.g. a staging file the user never asked for, in favour of the destination)."""
    cause = _CAUSES.get(error.errno, error.strerror or str(error))
    named = path if path is not None else error.filename
    return f"{named}: {cause}" if named is not None else cause


def explain_write_failure(error: BaseException, folder: str | Path) -> OSError | None:
    """The `OSError` behind a failed write into `folder`, for writers that hide it: safetensors reports it inside a
    `SafetensorError` ("... (os error 28)"), `torch.save` not at all ("unexpected pos 576 vs 534"), so a torch
    error on a full or read-only file system is taken for that. None when there is no OS cause to name."""
    if isinstance(error, OSError) and error.errno is not None:
        return error
    if isinstance(error, SafetensorError) and (code := re.search(r"os error (\d+)", str(error))):
        return OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(folder))
    if not isinstance(error, RuntimeError):
        return None
    try:
        usage = os.statvfs(folder)
    except OSError:
        return None
    free_blocks = usage.f_bfree if os.geteuid() == 0 else usage.f_bavail  # root may write into the reserve
    if free_blocks * usage.f_frsize < _NEARLY_FULL:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
    if usage.f_flag & os.ST_RDONLY:
        return OSError(errno.EROFS, os.strerror(errno.EROFS), str(folder))
    return None


@contextmanager
def writes_into(folder: str | Path, named: str | Path | None = None) -> Iterator[None]:
    """Re-raise a failed write into `folder` as the `OSError` behind it (see `explain_write_failure`), naming
    `named` (what the user asked for) where given, else the file the error names, else `folder`."""
    try:
        yield
    except Exception as error:
        cause = explain_write_failure(error, folder)
        if cause is None:
            raise
        path = named if named is not None else cause.filename if cause.filename is not None else folder
        raise OSError(cause.errno, cause.strerror, str(path)) from error


@contextmanager
def removed_if_left_empty(folder: str | Path) -> Iterator[None]:
    """On an error in the block, remove `folder` if the block created it and left nothing in it: a failed command
    leaves no trace of itself."""
    created = not os.path.lexists(folder)
    try:
        yield
    except BaseException:
        if created and os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)
        raise
