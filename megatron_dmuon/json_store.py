"""A JSON file of versioned entries, ``{"dmuon_cache": SIGNATURE, "entries": {key: entry}, "version": V}``:
the one on-disk store of the kernels' autotune cache (kernels/autotune.py) and the planner's NS
and rank profiles and owner plans (planning/caches.py).

Every file is recognised by its signature before it is read or replaced: the ``dmuon_cache`` key,
first in the file (keys are written sorted), names which cache it is; a file written before the
signature existed is ``{"entries": {...}, "version": V}`` and nothing else. A file that is not
ours (other JSON, other text, another of DMuon's caches, not a regular file) is refused with a
``ForeignCacheFile`` (a ValueError) naming it and where it is set, and is never touched. An empty
file holds nothing and is taken as an empty cache. A file of ours that no longer parses (cut
short), or of another format version, is ignored with a warning (its entries are rebuilt on use).
A write takes an exclusive lock on a side file, re-reads the file, merges and replaces it
atomically, keeping the file's mode (a new file gets the umask's): concurrent ranks neither
corrupt it nor drop each other's keys, and a failed write leaves no temporary file behind. A path
that cannot be written raises a ValueError naming the cache and where it is set.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import tempfile
import warnings
from pathlib import Path

from .files import JSON_LIMIT

__all__ = ["JsonStore", "ForeignCacheFile"]

SIGNATURE_KEY = "dmuon_cache"
# the first bytes of a file of ours, whole or cut short: the signature, or (written before the
# signature) the sorted layout's "entries" object
_SIGNED = re.compile(r'\A\s*\{\s*"dmuon_cache"\s*:\s*"([^"\\]*)("|\Z)')
_UNSIGNED = re.compile(r'\A\s*\{\s*"entries"\s*:\s*\{')


CACHE_LIMIT = JSON_LIMIT  # bytes: the largest cache of ours is a few MB
FOREIGN_FIX = "a new file path (or delete the file if it is an old cache you no longer need)"


class ForeignCacheFile(ValueError):
    """The file a cache is pointed at is not that cache: DMuon refuses it and leaves it untouched."""

    def __init__(self, why: str, store: "JsonStore"):
        article = "an" if store.label[:1].lower() in "aeiou" else "a"
        self.problem = f"is not {article} {store.label} file ({why}; DMuon replaces only files it wrote: left untouched)"
        super().__init__(f"the {store.label} {store.path} {self.problem}: point {store.env} at {FOREIGN_FIX}")


class JsonStore:
    """A JSON file of versioned entries (see the module docstring). Subclasses set ``version``,
    ``label`` (how messages name the file), ``env`` (where a user points it) and
    ``default_path``."""

    version = 1
    label = "DMuon cache"
    env = ""
    signature = ""  # the "dmuon_cache" value of this cache's files (default: "megatron_dmuon <label>")

    @staticmethod
    def default_path():
        raise NotImplementedError

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path if path is not None else self.default_path()).expanduser()
        self._entries: dict | None = None

    @classmethod
    def _signature(cls) -> str:
        return cls.signature or f"megatron_dmuon {cls.label}"

    def _foreign(self, why: str) -> "ForeignCacheFile":
        return ForeignCacheFile(why, self)

    def _read_file(self) -> dict:
        """The entries of the file (``{}`` where there is none yet, or it is empty, cut short or of
        another version: with a warning where it held something); ``ForeignCacheFile`` where the file
        is not this cache."""
        try:
            info = os.stat(self.path)
        except OSError:  # no file there (or no way to it: check_writable names the folder)
            return {}
        if stat.S_ISDIR(info.st_mode):
            return {}  # check_writable names it (a directory is never replaced)
        if not stat.S_ISREG(info.st_mode):
            raise self._foreign("it is not a regular file")
        if info.st_size > CACHE_LIMIT:  # no cache of ours grows to this: not read into memory
            raise self._foreign(f"it holds {info.st_size} bytes, more than a cache holds ({CACHE_LIMIT})")
        try:
            raw = self.path.read_bytes()
        except OSError as exc:
            raise self._foreign(f"it cannot be read: {exc.strerror or exc}") from None
        if not raw.strip():
            return {}  # an empty file (e.g. made by mktemp) holds nothing to lose
        head = raw[:4096].decode("utf-8", errors="replace")
        signed = _SIGNED.match(head)
        if signed and not (signed.group(1) == self._signature()
                           or (not signed.group(2) and self._signature().startswith(signed.group(1)))):
            raise self._foreign(f"it is {signed.group(1)!r}")  # another cache (or cut inside another's name)
        ours = bool(signed) or bool(_UNSIGNED.match(head))
        try:
            data = json.loads(raw.decode("utf-8"))
        except ValueError as exc:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
            if not ours:
                raise self._foreign(f"it does not read as JSON: {exc}") from None
            warnings.warn(f"{self.label} {self.path} is unreadable ({exc}); starting from an empty cache", RuntimeWarning)
            return {}
        if not isinstance(data, dict):
            raise self._foreign(f"it holds a JSON {type(data).__name__.replace('dict', 'object')}")
        if data.get(SIGNATURE_KEY, self._signature()) != self._signature():
            raise self._foreign(f"it is {data[SIGNATURE_KEY]!r}")
        if data.get(SIGNATURE_KEY) is None and set(data) != {"entries", "version"}:
            raise self._foreign(f"a JSON object without the {SIGNATURE_KEY!r} signature; its keys: "
                                + ", ".join(map(repr, sorted(data)[:5])) + (", ..." if len(data) > 5 else ""))
        if data.get("version") != self.version or not isinstance(data.get("entries"), dict):
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

    def check_writable(self) -> None:
        """A ValueError naming the file, the problem and the fix where it cannot be written: a
        directory in its place, a folder that cannot be created, or a file that is not this cache
        (refused, never replaced). What a job checks at start-up, before anything is built."""
        problem, fix = self._write_problem()
        if problem:
            raise ValueError(f"the {self.label} {self.path} {problem}: point {self.env} at {fix}")

    def _write_problem(self) -> tuple:
        # the path save() writes: through every link (a HOME that is a dangling link passed this
        # check and failed at the first save, after the model was built: [bad-input-5])
        path = Path(os.path.realpath(self.path))
        try:
            if path.is_dir():
                return "is a directory", "a writable file path"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a file of ours cut short is warned about where it is read
                self._read_file()
            base = path.parent
            while not base.exists() and base != base.parent:
                base = base.parent
        except ForeignCacheFile as exc:
            return exc.problem, FOREIGN_FIX
        except OSError as exc:  # a folder on the way that cannot be searched (a HOME of mode 000)
            return f"cannot be reached: {exc.strerror or exc} ({exc.filename})", "a writable file path"
        if not base.is_dir():
            return f"cannot be created: {base} is not a directory", "a writable file path"
        if not os.access(base, os.W_OK | os.X_OK):
            return f"cannot be created: {base} is not writable", "a writable file path"
        return None, None

    def save(self) -> None:
        target = Path(os.path.realpath(self.path))  # a symlinked cache stays a link: its file is updated
        self.check_writable()  # a file that is not ours is refused before anything is written
        target.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(target.with_name(target.name + ".lock")):
            merged = self._read_file()  # under the lock: every other writer's keys are in it
            merged.update(self.entries)
            self._entries = merged
            try:
                mode = stat.S_IMODE(os.stat(target).st_mode)
            except FileNotFoundError:
                mode = 0o666 & ~_umask()
            fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".json.tmp", dir=target.parent)
            try:
                os.fchmod(fd, mode)
                with os.fdopen(fd, "w") as fh:
                    json.dump({SIGNATURE_KEY: self._signature(), "version": self.version, "entries": merged}, fh,
                              indent=1, sort_keys=True)
                os.replace(tmp, target)
            except BaseException:
                if os.path.exists(tmp):  # no half-written temp files left behind
                    os.unlink(tmp)
                raise


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


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
