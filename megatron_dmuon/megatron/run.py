"""Run an unmodified Megatron-LM entry script with `--optimizer dmuon` available.

    torchrun --nproc-per-node 8 -m megatron_dmuon.megatron.run /path/to/Megatron-LM/pretrain_gpt.py <flags>
    torchrun --nproc-per-node 8 --no-python dmuon-megatron-lm /path/to/Megatron-LM/pretrain_gpt.py <flags>

The script's directory goes first on ``sys.path`` (as ``python SCRIPT`` puts it: the tree's
``megatron`` package and the script's neighbours, e.g. ``gpt_builders.py``), the hook is installed
(``megatron_lm.install()``: what patches/pretrain_gpt.patch calls), then the script runs as
``__main__`` with its own arguments. Any entry script that parses Megatron-LM's arguments and builds
its model and optimizer through ``megatron.training`` works the same way (``pretrain_gpt.py``,
``pretrain_mamba.py``). A tree whose ``megatron.training`` lacks a symbol the hook replaces is
refused before the script starts, naming the symbol. ``patches/apply.sh`` stays for those who
prefer a patched script.

The tree is the script's own: a symlinked script is resolved to the checkout it lives in, and the
script's directory must hold ``megatron/training/`` (a Megatron-LM checkout), or a checkout must be
on ``PYTHONPATH``; megatron-core's wheel, which ships a ``megatron.training`` too, is not a tree.
``megatron.training`` must then import from that tree, and a module of it that fails to import for
want of a package is named with the fix (``pip install ...``), all before the script starts.
"""
from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m megatron_dmuon.megatron.run /path/to/Megatron-LM/SCRIPT.py [its arguments...]"
ENTRY_SCRIPTS = ("pretrain_gpt.py", "pretrain_mamba.py", "pretrain_hybrid.py")
GET_A_TREE = "clone NVIDIA/Megatron-LM (tag core_v0.19.0, or main) and run its script"


def _refuse(message: str, code: int = 2) -> None:
    print(f"megatron_dmuon.megatron.run: {message}", file=sys.stderr)
    raise SystemExit(code)


def _holds_tree(directory: str) -> bool:
    return os.path.isdir(os.path.join(directory, "megatron", "training"))


def pythonpath_checkouts() -> list:
    """The Megatron-LM checkouts on $PYTHONPATH: a directory holding megatron/training/ and an entry
    script (a site-packages directory holding megatron-core's wheel is not one)."""
    return [d for d in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if d and _holds_tree(d) and any(os.path.isfile(os.path.join(d, s)) for s in ENTRY_SCRIPTS)]


def script_tree(path: str) -> tuple:
    """(script, tree): the script with its symlinks resolved, and the Megatron-LM tree it runs on:
    its own directory where that holds megatron/training/, else the first checkout on $PYTHONPATH.
    Raises ValueError naming the script, what is missing and the fix."""
    if not path.endswith(".py") or not os.path.isfile(path):
        raise ValueError(f"{path} is not a Python script; {USAGE}")
    script = os.path.realpath(path)  # a symlink: the tree is the checkout the script lives in
    here = os.path.dirname(script)
    if _holds_tree(here):
        return script, here
    elsewhere = pythonpath_checkouts()
    if elsewhere:
        return script, os.path.abspath(elsewhere[0])
    name = os.path.basename(script)
    if name in ENTRY_SCRIPTS:
        raise ValueError(f"{path} is Megatron-LM's {name} outside its checkout: its tree (megatron/training/, "
                         f"the builders it imports) is not beside it in {here}. Run the checkout's own script "
                         f"(/path/to/Megatron-LM/{name}), or put the checkout on PYTHONPATH")
    raise ValueError(f"{here} is not a Megatron-LM checkout (no megatron/training/ beside {name}, and no checkout "
                     f"on PYTHONPATH): the launcher runs a Megatron-LM tree's entry script ({', '.join(ENTRY_SCRIPTS)}); "
                     f"{GET_A_TREE}")


def _import_problem(module: str, exc: BaseException, tree: str) -> str:
    """The message for a tree module that does not import for a reason other than being absent."""
    missing = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    if isinstance(exc, ModuleNotFoundError) and missing:
        top = missing.split(".")[0]
        return (f"importing {module} from {tree} failed: {exc} (the tree needs it): pip install {top} (or the "
                "package that provides it) into this environment")
    return f"importing {module} from {tree} failed ({type(exc).__name__}: {exc})"


def missing_hook_points(tree: str = "the Megatron-LM tree") -> list:
    """'module.attribute' of every hook point (``megatron_lm.HOOK_POINTS``) the importable
    ``megatron.training`` lacks. A module that exists but fails to import (a package it needs is
    missing) raises ImportError with the message ``_import_problem`` writes: it is not a missing
    hook point."""
    import importlib

    from .megatron_lm import HOOK_POINTS

    missing = []
    for module, attribute in HOOK_POINTS:
        try:
            found = hasattr(importlib.import_module(module), attribute)
        except ImportError as exc:
            name = exc.name or ""
            if not name or not (module == name or module.startswith(name + ".")):
                raise ImportError(_import_problem(module, exc, tree)) from exc
            found = False  # the module itself is not in this tree
        except Exception as exc:  # noqa: BLE001 - any failure of the tree's own import, named
            raise ImportError(_import_problem(module, exc, tree)) from exc
        if not found:
            missing.append(f"{module}.{attribute}")
    return missing


def _check_training_origin(tree: str) -> None:
    """megatron.training must come from ``tree`` (not from megatron-core's wheel)."""
    try:
        import megatron.training as training
    except Exception as exc:  # noqa: BLE001
        _refuse(_import_problem("megatron.training", exc, tree))
    origin = os.path.realpath(os.path.dirname(getattr(training, "__file__", None) or "") or
                              next(iter(getattr(training, "__path__", [])), ""))
    if not origin.startswith(os.path.join(os.path.realpath(tree), "megatron", "training")):
        _refuse(f"megatron.training imports from {origin}, not from the tree {tree}: its megatron/training/ lacks "
                "an __init__.py, or another megatron package was imported first; run a Megatron-LM checkout's "
                "own script")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() if argv else USAGE, file=sys.stderr if not argv else sys.stdout)
        raise SystemExit(0 if argv else 2)
    try:
        script, tree = script_tree(argv[0])
    except ValueError as e:
        _refuse(str(e))
    here = os.path.dirname(script)
    sys.path.insert(0, here)  # as `python SCRIPT` puts it: the script's neighbours (gpt_builders.py, ...)
    if tree != here and tree not in sys.path:
        sys.path.insert(1, tree)
    _check_training_origin(tree)
    try:
        missing = missing_hook_points(tree)
    except ImportError as e:
        _refuse(str(e))
    if missing:
        _refuse(f"this Megatron-LM's megatron.training has no {', '.join(missing)}, which the DMuon hook replaces; "
                "the supported trees are core_v0.19.0 and main of 2026-08-22 (docs/megatron_lm.md)")
    from .megatron_lm import install

    install()
    sys.argv = [script, *argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
