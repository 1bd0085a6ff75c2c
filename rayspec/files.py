"""Whole-file writes: a file that exists at its path is complete (no reader sees it half-written)."""

from __future__ import annotations

import os
import uuid


def write_atomic(path: str, data: bytes | str) -> None:
    """Write ``data`` (bytes, or text as UTF-8) to ``path`` through a temporary file beside it and one
    :func:`os.replace`, so ``path`` holds either its old content or all of ``data``, never part of it.

    The temporary file (``<path>.<random hex>.tmp``, unique per call, so concurrent writers of one path do not mix
    their bytes) is removed when the write fails; its directory must exist. On POSIX the rename is atomic within one
    file system; nothing is ``fsync``-ed, so a power loss can still lose the new content (not mix it).

    Raises:
        OSError: the directory is missing or not writable, or the disk is full (``path`` is then left as it was).
        TypeError: ``data`` is neither ``bytes`` nor ``str``.
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    elif not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"write_atomic takes bytes or str, not {type(data).__name__}")
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
