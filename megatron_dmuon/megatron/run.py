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
"""
from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m megatron_dmuon.megatron.run /path/to/Megatron-LM/SCRIPT.py [its arguments...]"

def _refuse(message: str, code: int = 2) -> None:
    print(f"megatron_dmuon.megatron.run: {message}", file=sys.stderr)
    raise SystemExit(code)


def missing_hook_points() -> list:
    """'module.attribute' of every hook point (``megatron_lm.HOOK_POINTS``) the importable
    ``megatron.training`` lacks."""
    import importlib

    from .megatron_lm import HOOK_POINTS

    missing = []
    for module, attribute in HOOK_POINTS:
        try:
            found = hasattr(importlib.import_module(module), attribute)
        except ImportError:
            found = False
        if not found:
            missing.append(f"{module}.{attribute}")
    return missing


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() if argv else USAGE, file=sys.stderr if not argv else sys.stdout)
        raise SystemExit(0 if argv else 2)
    script = os.path.abspath(argv[0])
    if not script.endswith(".py") or not os.path.isfile(script):
        _refuse(f"{argv[0]} is not a Python script; {USAGE}")
    tree = os.path.dirname(script)
    sys.path.insert(0, tree)
    if not os.path.isfile(os.path.join(tree, "megatron", "training", "arguments.py")):
        try:
            import megatron.training  # noqa: F401  (a tree on PYTHONPATH serves as well)
        except ImportError:
            _refuse(f"{tree} is not a Megatron-LM checkout (no megatron/training/) and no megatron.training imports "
                    "here: clone NVIDIA/Megatron-LM (tag core_v0.19.0, or main) and run its script")
    missing = missing_hook_points()
    if missing:
        _refuse(f"this Megatron-LM's megatron.training has no {', '.join(missing)}, which the DMuon hook replaces; "
                "the supported trees are core_v0.19.0 and main of 2026-08-22 (docs/megatron_lm.md)")
    from .megatron_lm import install

    install()
    sys.argv = [script, *argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
