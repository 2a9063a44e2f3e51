"""Every module of the package imports, and the package says the version that setup.cfg ships."""
import configparser
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import megatron_dmuon

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter, so the result does not depend on what other tests imported first.
IMPORT_ALL = """
import importlib, json, pkgutil, traceback
import megatron_dmuon
failures = {}
names = [m.name for m in pkgutil.walk_packages(megatron_dmuon.__path__, "megatron_dmuon.")]
for name in names:
    try:
        importlib.import_module(name)
    except BaseException:
        failures[name] = traceback.format_exc(limit=-3)
print(json.dumps({"imported": names, "failures": failures}))
"""


def test_every_module_imports():
    run = subprocess.run([sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    expected = {m.name for m in pkgutil.walk_packages(megatron_dmuon.__path__, "megatron_dmuon.")}
    # The walk itself must have seen the subpackages (a missing __init__.py would hide them).
    for package in ("algorithms", "kernels", "planning", "runtime", "megatron", "megatron.bridge", "megatron.checkpoint",
                    "testing", "decentralized"):
        assert f"megatron_dmuon.{package}" in expected
    assert set(report["imported"]) == expected
    failures = dict(report["failures"])
    # the Megatron-Bridge adapter needs Bridge, an optional dependency (docs/bridge.md): where Bridge
    # itself does not import (not installed; or installed without Transformer Engine, which it
    # imports unguarded), only that module may fail, and only with an import error
    adapter = failures.pop("megatron_dmuon.megatron.bridge.adapter", None)
    if adapter is not None:
        bridge = subprocess.run([sys.executable, "-c", "import megatron.bridge.training.config"], capture_output=True)
        assert bridge.returncode != 0 and ("ModuleNotFoundError" in adapter or "ImportError" in adapter), adapter
    assert not failures, "modules that fail to import:\n" + "\n".join(
        f"{name}:\n{error}" for name, error in failures.items()
    )


def test_version_matches_setup_cfg():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert megatron_dmuon.__version__ == config["metadata"]["version"]
