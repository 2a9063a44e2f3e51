"""The planner's on-disk caches: NS profiles (``ProfileCache``) and finished owner plans (``PlanCache``).

Both are ``JsonStore`` files ``{"version": V, "entries": {key: entry}}``, the format the kernels'
autotune cache (kernels/autotune.py) also writes, so cache files written before planning/ had a
store of its own still load. A file that is unreadable, or of another format version, is ignored
with a warning (its entries are rebuilt on use). A write takes an exclusive lock on a side file,
re-reads the file, merges and replaces it atomically: concurrent ranks neither corrupt it nor drop
each other's keys, and a failed write leaves no temporary file behind. A path that cannot be
written raises a ValueError naming the cache and where it is set.

Paths: the ``path`` argument, else ``$DMUON_PROFILE_CACHE`` / ``$DMUON_PLAN_CACHE``, else
``~/.cache/megatron_dmuon/ns_profile.json`` / ``owner_plans.json``.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

__all__ = ["JsonStore", "ProfileCache", "PlanCache", "PROFILE_VERSION", "PROFILE_CACHE_ENV", "PLAN_CACHE_ENV",
           "default_profile_cache_path", "default_plan_cache_path", "plan_key"]

PROFILE_VERSION = 1
PROFILE_CACHE_ENV = "DMUON_PROFILE_CACHE"
PLAN_CACHE_ENV = "DMUON_PLAN_CACHE"


def cache_file_path(env_var: str, file_name: str) -> str:
    """``$env_var`` (user-expanded), else ``~/.cache/megatron_dmuon/<file_name>``."""
    env = os.environ.get(env_var)
    return os.path.expanduser(env) if env else os.path.join(os.path.expanduser("~"), ".cache", "megatron_dmuon",
                                                            file_name)


def default_profile_cache_path() -> Path:
    return Path(cache_file_path(PROFILE_CACHE_ENV, "ns_profile.json"))


def default_plan_cache_path() -> str:
    return cache_file_path(PLAN_CACHE_ENV, "owner_plans.json")


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


class ProfileCache(JsonStore):
    """``{"version": PROFILE_VERSION, "entries": {profile_key: CostTable JSON}}``."""

    version = PROFILE_VERSION
    label = "DMuon NS profile cache"
    env = f"${PROFILE_CACHE_ENV}"
    default_path = staticmethod(default_profile_cache_path)


class PlanCache(JsonStore):
    """``{"version": 1, "entries": {plan_key: plan JSON}}``."""

    version = 1
    label = "DMuon owner plan cache"
    env = f"${PLAN_CACHE_ENV}"
    default_path = staticmethod(default_plan_cache_path)


def plan_key(payload) -> str:
    """Hash of a JSON-able description of everything a plan depends on. A ``time_limit_s`` inside
    it is left out: the limit a start-up budget leaves varies from start to start, the problem
    does not."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "time_limit_s"}
        if isinstance(value, (list, tuple)):
            return [strip(v) for v in value]
        return value

    return hashlib.sha256(json.dumps(strip(payload), sort_keys=True, default=str).encode()).hexdigest()
