"""Files written whole or not at all: a crash mid-write never leaves a half-written file in place.

``write_atomic`` writes to a temporary file beside the target (same folder, so the rename stays
on one filesystem), fsyncs it, and renames it over the target; on any failure the temporary
file is removed. Snapshots (``checkpoint``) and token shards' manifests use it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes, *, prefix: str | None = None, suffix: str = ".tmp",
                 mode: int | None = None) -> None:
    """``data`` as the whole of ``path``, or ``path`` untouched (see the module docstring)."""
    path = Path(path)
    fd, temp = tempfile.mkstemp(prefix=prefix if prefix is not None else f".{path.name}.", suffix=suffix,
                                dir=path.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
