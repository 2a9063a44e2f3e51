"""A JSON file of versioned entries, ``{"version": V, "entries": {key: entry}}``: the one on-disk
store of the kernels' autotune cache (kernels/autotune.py) and the planner's NS profiles and owner
plans (planning/caches.py).

A file that is unreadable, or of another format version, is ignored with a warning (its entries
are rebuilt on use). A write takes an exclusive lock on a side file, re-reads the file, merges and
replaces it atomically: concurrent ranks neither corrupt it nor drop each other's keys, and a
failed write leaves no temporary file behind. A path that cannot be written raises a ValueError
naming the cache and where it is set.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import warnings
from pathlib import Path

__all__ = ["JsonStore"]


class JsonStore:
    """A JSON file of versioned entries (see the module docstring). Subclasses set ``version``,
    ``label`` (how messages name the file), ``env`` (where a user points it) and
    ``default_path``."""

    version = 1
    label = "DMuon cache"
    env = ""

    @staticmethod
    def default_path():
        raise NotImplementedError

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path if path is not None else self.default_path()).expanduser()
        self._entries: dict | None = None

    def _read_file(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            warnings.warn(f"{self.label} {self.path} is unreadable ({exc}); starting from an empty cache", RuntimeWarning)
            return {}
        if not isinstance(data, dict) or data.get("version") != self.version or not isinstance(data.get("entries"), dict):
            warnings.warn(
                f"{self.label} {self.path} has an unknown format or an older version "
                f"(expected version {self.version}); ignoring its contents, they are rebuilt on use", RuntimeWarning
            )
            return {}
        return data["entries"]

    @property
    def entries(self) -> dict:
        if self._entries is None:
            self._entries = self._read_file()
        return self._entries

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def put(self, key: str, entry: dict, save: bool = True) -> None:
        self.entries[key] = entry
        if save:
            self.save()

    def writable_problem(self) -> str | None:
        """Why this file cannot be written (or None): a directory in its place, or a folder that
        cannot be created."""
        path = self.path
        if path.is_dir():
            return "is a directory"
        base = path.parent
        while not base.exists() and base != base.parent:
            base = base.parent
        if not base.is_dir():
            return f"cannot be created: {base} is not a directory"
        if not os.access(base, os.W_OK | os.X_OK):
            return f"cannot be created: {base} is not writable"
        return None

    def save(self) -> None:
        problem = self.writable_problem()
        if problem:
            raise ValueError(f"{self.label} {self.path} {problem}: point {self.env} at a writable file path")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(self.path.with_name(self.path.name + ".lock")):
            merged = self._read_file()  # under the lock: every other writer's keys are in it
            merged.update(self.entries)
            self._entries = merged
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.stem}.", suffix=".json.tmp", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as fh:
                    json.dump({"version": self.version, "entries": merged}, fh, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
            except BaseException:
                if os.path.exists(tmp):  # no half-written temp files left behind
                    os.unlink(tmp)
                raise


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path):
    """An advisory exclusive lock (fcntl) held for the block; a no-op where fcntl is missing."""
    try:
        import fcntl
    except ImportError:  # not POSIX: atomic replace alone (a concurrent writer's key may be lost)
        yield
        return
    with open(lock_path, "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
