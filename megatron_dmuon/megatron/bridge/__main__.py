"""Run a Megatron-Bridge entry script with ``optimizer.optimizer=dmuon`` available.

    torchrun --nproc-per-node 8 -m megatron_dmuon.bridge [--dmuon-* flags] scripts/training/run_recipe.py \\
        --recipe qwen3_8b_pretrain_config optimizer.optimizer=dmuon ...
    torchrun --nproc-per-node 8 --no-python dmuon-bridge [--dmuon-* flags] SCRIPT.py ...

The ``--dmuon-*`` flags before the script are DMuon's own options (``--dmuon-ns-launch graph``; the
same flags as under Megatron-LM); the rest goes to the script, which runs unmodified as ``__main__``
after ``megatron_dmuon.bridge.install()``.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys

USAGE = "usage: python -m megatron_dmuon.bridge [--dmuon-* flags] SCRIPT.py [its arguments...]"


def split_argv(argv: list) -> tuple:
    """(DMuon's options by name, the script, its arguments): the ``--dmuon-*`` flags before the
    script are parsed with DMuon's own parser (its choices and types)."""
    from ..flags import add_dmuon_args

    script_at = next((i for i, a in enumerate(argv) if a.endswith(".py") and not a.startswith("-")), None)
    if script_at is None:
        raise SystemExit(f"megatron_dmuon.bridge: no Python script given; {USAGE}")
    ours = argv[:script_at]
    stray = [a for a in ours if a.startswith("-") and not a.startswith("--dmuon-")]
    if stray:
        raise SystemExit(f"megatron_dmuon.bridge: {', '.join(stray)} before the script: only --dmuon-* flags go "
                         f"there (the script's own arguments follow it); {USAGE}")
    parser = add_dmuon_args(argparse.ArgumentParser(prog="python -m megatron_dmuon.bridge", add_help=False),
                            validate=False)
    defaults = vars(parser.parse_args([]))
    given = vars(parser.parse_args(ours))
    options = {k[len("dmuon_"):]: v for k, v in given.items() if k.startswith("dmuon_") and v != defaults[k]}
    return options, os.path.abspath(argv[script_at]), argv[script_at + 1:]


def _check_bridge_imports() -> None:
    """Megatron-Bridge must import before DMuon installs into it (without it: a ModuleNotFoundError
    traceback from the adapter, [bad-input-5])."""
    try:
        from . import adapter  # noqa: F401 (the one module that imports megatron.bridge)
    except ImportError as e:
        missing = getattr(e, "name", None) or str(e)
        if missing.startswith("megatron.bridge") or missing == "megatron":
            raise SystemExit("megatron_dmuon.bridge: Megatron-Bridge is not installed (no module megatron.bridge): "
                             "pip install megatron-bridge (docs/bridge.md), then run it again") from None
        raise SystemExit(f"megatron_dmuon.bridge: Megatron-Bridge does not import: it needs {missing}, which is "
                         f"missing ({e}): pip install {missing.split('.')[0]} (or reinstall megatron-bridge)") from None


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() if argv else USAGE, file=sys.stderr if not argv else sys.stdout)
        raise SystemExit(0 if argv else 2)
    try:
        options, script, rest = split_argv(argv)
        if not os.path.isfile(script):
            raise SystemExit(f"megatron_dmuon.bridge: {script} does not exist; {USAGE}")
        _check_bridge_imports()
    except SystemExit as e:  # a usage error: one line, exit 2 (as argparse)
        if not isinstance(e.code, str):
            raise
        sys.stderr.write(e.code.replace("megatron_dmuon.bridge: ", "megatron_dmuon.bridge: error: ", 1) + "\n")
        raise SystemExit(2) from None
    from . import install

    install(**options)
    sys.path.insert(0, os.path.dirname(script))
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
