"""Reading a file someone else may have written: a regular file of bounded size, read as data.

Every input the package reads from a path a user names (checkpoint metadata, JSON plans, profiles,
caches, rank models) goes through here first, so that ``/dev/zero``, a FIFO or a directory is named
as what it is instead of being read until memory runs out or blocking forever. Standard library only.
"""
from __future__ import annotations

import os
import stat

MiB = 1 << 20
JSON_LIMIT = 256 * MiB  # a plan, profile or cache of the largest model is a few MB


def check_regular_file(path, what: str, limit: int = JSON_LIMIT) -> int:
    """The size of ``path`` in bytes, after checking that it is a regular file of at most ``limit``
    bytes; else ``ValueError`` naming ``what`` and the path (missing, a directory, a device or FIFO,
    too large)."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ValueError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{what} {path} is a directory, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{what} {path} is not a regular file (a device, FIFO or socket): give a file")
    if info.st_size > limit:
        raise ValueError(f"{what} {path} holds {info.st_size} bytes, more than the {limit} such a file can hold: "
                         "is it the right file?")
    return info.st_size


def read_bounded_bytes(path, what: str, limit: int = JSON_LIMIT) -> bytes:
    """The bytes of ``path`` (``check_regular_file`` first; at most ``limit`` are read even if the file
    grows meanwhile)."""
    check_regular_file(path, what, limit)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise ValueError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise ValueError(f"{what} {path} grew past {limit} bytes while it was read")
    return data


def read_bounded_text(path, what: str, limit: int = JSON_LIMIT) -> str:
    """The UTF-8 text of ``path`` (``read_bounded_bytes``); ``ValueError`` naming it if it is not text."""
    data = read_bounded_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {path} is not UTF-8 text ({exc.reason} at byte {exc.start}): is it the right "
                         "file?") from None
