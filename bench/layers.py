"""The layer and precision flags the main-job benchmarks (e2e.py, quality.py) pass to
examples/pretrain_gpt.py: Megatron-LM's names, the main job's defaults (TE where it imports on a GPU)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (the repository, for the package)
from megatron_dmuon.megatron.gpt import FP8_FORMATS, FP8_RECIPES, TRANSFORMER_IMPLS  # noqa: E402


def add_layer_args(p) -> None:
    p.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default=None,
                   help="the main job's layers (default: TE where transformer_engine imports on a GPU, else local)")
    p.add_argument("--fp8-format", choices=FP8_FORMATS, default=None, help="FP8 GEMMs through TE")
    p.add_argument("--fp8-recipe", choices=FP8_RECIPES, default=None)
    p.add_argument("--fp8-param-gather", action="store_true", help="TE FP8 params")


def job_layer_args(args) -> list:
    """The flags of ``add_layer_args`` as the main job takes them (only those given)."""
    out = []
    if args.transformer_impl:
        out += ["--transformer-impl", args.transformer_impl]
    if args.fp8_format:
        out += ["--fp8-format", args.fp8_format]
    if args.fp8_recipe:
        out += ["--fp8-recipe", args.fp8_recipe]
    if args.fp8_param_gather:
        out.append("--fp8-param-gather")
    return out


def layers_of(summary: dict) -> str:
    """What a finished run ran, from its summary: 'TE', 'TE fp8 hybrid/delayed', 'local' ..."""
    impl = summary.get("transformer_impl")
    text = {"transformer_engine": "TE", "local": "local"}.get(impl, "local (before TE)" if impl is None else impl)
    fp8 = summary.get("fp8")
    if fp8:
        text += f" fp8 {fp8['format']}/{fp8['recipe']}" + (" fp8-params" if fp8.get("param_gather") else "")
    return text
