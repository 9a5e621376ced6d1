"""Atomic file writes: a reader (or a crash) sees the old file or the new one, never half of one."""

import os
import tempfile
from pathlib import Path


def write_text_atomically(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to a temporary file beside `path`, then rename it onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
        os.chmod(temporary, 0o644)  # mkstemp makes it private; these files are meant to be read
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path
