"""The planner's on-disk caches: start-up rank profiles (``ProfileCache``) and finished owner plans (``PlanCache``).

Both are ``JsonStore`` files (megatron_dmuon/json_store.py: versioned entries, locked merging
writes, a signature that names the cache: a file that is not this cache is refused and left
untouched), the store the kernels' autotune cache uses too. ``ProfileCache`` holds the start-up
profiles of the whole owner step (runtime/rank_profile.py), one entry per device and settings.

Paths: the ``path`` argument, else ``$DMUON_PROFILE_CACHE`` / ``$DMUON_PLAN_CACHE``, else
``~/.cache/megatron_dmuon/ns_profile.json`` / ``owner_plans.json``.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..json_store import JsonStore

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


class ProfileCache(JsonStore):
    """``{"dmuon_cache": signature, "entries": {key: rank profile}, "version": PROFILE_VERSION}``."""

    version = PROFILE_VERSION
    label = "DMuon NS profile cache"
    signature = "megatron_dmuon NS profile cache"  # (json_store: every file is recognised by it)
    env = f"${PROFILE_CACHE_ENV}"
    default_path = staticmethod(default_profile_cache_path)


class PlanCache(JsonStore):
    """``{"dmuon_cache": signature, "entries": {plan_key: plan JSON}, "version": 1}``."""

    version = 1
    label = "DMuon owner plan cache"
    signature = "megatron_dmuon owner plan cache"
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
