"""Let Megatron-Bridge's training path import where two of its imports cannot (test infrastructure and
the offline H200 image; never for a real Bridge install, where both are there).

* ``without_transformer_engine()``: megatron/bridge/peft/lora_layers.py imports Transformer Engine
  unguarded, and every Bridge import reaches it. On a CPU machine without TE, that one module is
  loaded with the import replaced by a stub. megatron-core's own ``try: import
  transformer_engine`` checks still see no TE, and nothing a GPT pretrain runs touches the stub.
* ``without_model_bridges()``: megatron/bridge/__init__.py and recipes/__init__.py import every HF
  and diffusion model bridge (diffusers). The two packages are registered without running their
  ``__init__``; their submodules (training, models, recipes.utils) import as usual.

``install()`` does both, each only where needed.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

_TE_IMPORTS = {"megatron.bridge.peft.lora_layers": "import transformer_engine.pytorch as te"}
_BARE_PACKAGES = ("megatron.bridge", "megatron.bridge.recipes")


class TEStub:
    """Stands for ``transformer_engine.pytorch``: every capitalized attribute is a fresh class (so
    ``isinstance(x, te.Linear)`` is False), every other one a nested stub."""

    def __init__(self, name: str):
        self.__name__ = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = type(attr, (), {"__module__": self.__name__}) if attr[:1].isupper() else TEStub(f"{self.__name__}.{attr}")
        setattr(self, attr, value)
        return value


class _StubbedTELoader(importlib.machinery.SourceFileLoader):
    def source_to_code(self, data, path, *, _optimize=-1):
        source = data.decode("utf-8") if isinstance(data, bytes) else data
        line = _TE_IMPORTS[self.name]
        if line not in source:
            raise ImportError(f"bridge_imports: '{line}' is no longer in {path}; update _TE_IMPORTS")
        source = source.replace(line, f"te = __import__('{__name__}', fromlist=['TEStub']).TEStub('transformer_engine.pytorch')", 1)
        return compile(source, path, "exec", dont_inherit=True, optimize=_optimize)

    def get_code(self, fullname):  # never a cached .pyc: the rewrite always applies
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)


class _StubbedTEFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _TE_IMPORTS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None:
            return None
        return importlib.util.spec_from_file_location(fullname, spec.origin, loader=_StubbedTELoader(fullname, spec.origin))


def _imports(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except Exception:  # noqa: BLE001 (a broken install counts as missing)
        return False


def without_transformer_engine() -> None:
    if not _imports("transformer_engine.pytorch") and not any(isinstance(f, _StubbedTEFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubbedTEFinder())


def _lazy_bridge_attribute(name):
    if name == "AutoBridge":
        return importlib.import_module("megatron.bridge.models.conversion.auto_bridge").AutoBridge
    info = importlib.import_module("megatron.bridge.package_info")
    if name.startswith("__") and hasattr(info, name):
        return getattr(info, name)
    raise AttributeError(f"module 'megatron.bridge' has no attribute {name!r}")


def without_model_bridges() -> None:
    if _imports("diffusers"):
        return
    for name in _BARE_PACKAGES:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None:
            return  # no Bridge installed: nothing to do
        module = importlib.util.module_from_spec(spec)
        module.__path__ = list(spec.submodule_search_locations)
        if name == "megatron.bridge":
            module.__getattr__ = _lazy_bridge_attribute
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        setattr(importlib.import_module(parent), child, module)


def install() -> None:
    without_transformer_engine()
    without_model_bridges()
