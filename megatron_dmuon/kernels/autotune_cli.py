"""``dmuon autotune``: pre-warm the kernel autotune cache for a model's matrix shapes.

Shapes come from ``--shapes 3584x3584,512x3584,...`` and/or from transformer numbers
(``--hidden --ffn --heads --query-groups [--head-dim] [--layers]``), in Megatron's parameter
layout: linear_qkv [(heads + 2·groups)·head_dim, hidden] (or q/k/v separately with
``--split-qkv``), linear_proj [hidden, heads·head_dim], linear_fc1 [2·ffn, hidden] for SwiGLU
(or gate/up separately with ``--split-fc1``; [ffn, hidden] with ``--no-swiglu``), linear_fc2
[hidden, ffn]. Every distinct shape is tuned in its wide orientation for each ``--batches``
size: the symmetric kernels (``syrk`` and ``square`` products) and, unless ``--no-methods``,
the Gram-vs-standard choice. ``--dry-run`` only lists the work.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'3584x3584,512x3584' -> [(3584, 3584), (512, 3584)]."""
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes: {item!r} is not ROWSxCOLS with positive integers (e.g. 3584x18944)")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def model_shapes(
    hidden: int, ffn: int, heads: int, query_groups: int | None = None, head_dim: int | None = None,
    split_qkv: bool = False, split_fc1: bool = False, swiglu: bool = True,
) -> dict[str, tuple[int, int]]:
    """Weight shapes of one transformer layer in Megatron's layout (name -> (rows, cols))."""
    for name, value in (("hidden", hidden), ("ffn", ffn), ("heads", heads)):
        if value is None or value < 1:
            raise ValueError(f"--{name} must be a positive integer, got {value!r}")
    groups = heads if query_groups is None else query_groups
    if groups < 1 or heads % groups:
        raise ValueError(f"--query-groups must divide --heads ({heads}), got {query_groups!r}")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"--hidden ({hidden}) is not divisible by --heads ({heads}); pass --head-dim")
        head_dim = hidden // heads
    shapes = {}
    if split_qkv:
        shapes["q"] = (heads * head_dim, hidden)
        shapes["k"] = shapes["v"] = (groups * head_dim, hidden)
    else:
        shapes["linear_qkv"] = ((heads + 2 * groups) * head_dim, hidden)
    shapes["linear_proj"] = (hidden, heads * head_dim)
    if swiglu and split_fc1:
        shapes["gate"] = shapes["up"] = (ffn, hidden)
    else:
        shapes["linear_fc1"] = ((2 if swiglu else 1) * ffn, hidden)
    shapes["linear_fc2"] = (hidden, ffn)
    return shapes


def work_items(named: dict[str, tuple[int, int]], batches: list[int]) -> list[tuple[int, int, int, list[str]]]:
    """Distinct wide shapes (m <= n) × batch sizes, with the parameter names sharing them."""
    wide: dict[tuple[int, int], list[str]] = {}
    for name, (rows, cols) in named.items():
        wide.setdefault((min(rows, cols), max(rows, cols)), []).append(name)
    return [(m, n, b, names) for (m, n), names in sorted(wide.items()) for b in batches]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dmuon autotune", description="Pre-warm the Gram NS kernel autotune cache.")
    p.add_argument("--shapes", default="", help="comma-separated ROWSxCOLS list")
    p.add_argument("--hidden", type=int)
    p.add_argument("--ffn", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--query-groups", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--layers", type=int, default=1, help="layers in the model (reported per shape; caps batches)")
    p.add_argument("--split-qkv", action="store_true")
    p.add_argument("--split-fc1", action="store_true")
    p.add_argument("--no-swiglu", action="store_true")
    p.add_argument("--batches", default="1,2,4,8", help="owner batch sizes to tune, comma-separated")
    p.add_argument("--dtype", default="float16", choices=sorted(DTYPES))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--coefficients", default="polar_express")
    p.add_argument("--cache", default=None, help="cache file (default $DMUON_AUTOTUNE_CACHE or ~/.cache/megatron_dmuon/autotune.json)")
    p.add_argument("--no-methods", action="store_true", help="tune only the kernels, not Gram-vs-standard")
    p.add_argument("--dry-run", action="store_true", help="list the work and exit")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        named = {f"shape{i}": s for i, s in enumerate(parse_shapes(args.shapes))}
        model_numbers = (args.hidden, args.ffn, args.heads)
        if any(v is not None for v in model_numbers):
            if any(v is None for v in model_numbers):
                raise ValueError("--hidden, --ffn and --heads must be given together (plus optional --query-groups)")
            named.update(model_shapes(args.hidden, args.ffn, args.heads, args.query_groups, args.head_dim,
                                      args.split_qkv, args.split_fc1, not args.no_swiglu))
        if not named:
            raise ValueError("no shapes: pass --shapes ROWSxCOLS,... or --hidden/--ffn/--heads")
        try:
            batches = sorted({int(b) for b in args.batches.split(",") if b.strip()})
        except ValueError:
            batches = [0]
        if not batches or batches[0] < 1:
            raise ValueError(f"--batches must be positive integers, got {args.batches!r}")
        if args.layers < 1:
            raise ValueError(f"--layers must be >= 1, got {args.layers}")
        for flag, value in (("--steps", args.steps), ("--head-dim", args.head_dim)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        from ..algorithms.coefficients import COEFFICIENT_SETS
        from .autotune import get_cache

        if args.coefficients not in COEFFICIENT_SETS:
            raise ValueError(f"--coefficients {args.coefficients!r} unknown; valid: {', '.join(COEFFICIENT_SETS)}")
        cache = get_cache(args.cache)
        try:
            cache.check_writable()  # a directory or a file that is not this cache: refused, left untouched
        except ValueError as exc:
            raise ValueError(str(exc).replace(f"point {cache.env}", "point --cache" if args.cache else
                                              f"point {cache.env}")) from None
    except ValueError as exc:
        print(f"dmuon autotune: {exc}", file=sys.stderr)
        return 2

    items = work_items(named, batches)
    per_shape_count = {}
    for name, (rows, cols) in named.items():
        key = (min(rows, cols), max(rows, cols))
        per_shape_count[key] = per_shape_count.get(key, 0) + args.layers
    items = [it for it in items if it[2] <= max(per_shape_count[(it[0], it[1])], 1)]
    print(f"{len(items)} (shape, batch) items to tune:")
    for m, n, b, names in items:
        print(f"  {m}x{n} batch {b}  ({', '.join(names)}; {per_shape_count[(m, n)]} in the model)")
    if args.dry_run:
        return 0
    if not torch.cuda.is_available():
        print("dmuon autotune: needs a CUDA GPU (the cache is per GPU model); use --dry-run to list the work", file=sys.stderr)
        return 2

    from .autotune import default_cache_path, get_cache, tune_op
    from .method_tuning import tune_method

    dtype = DTYPES[args.dtype]
    device = torch.device("cuda", torch.cuda.current_device())
    cache = get_cache(args.cache)
    print(f"cache: {cache.path if args.cache else default_cache_path()}")
    for m, n, b, _ in items:
        t0 = time.time()
        syrk = tune_op("syrk", m, n, b, dtype, device, cache=cache)
        square = tune_op("square", m, m, b, dtype, device, cache=cache)
        line = f"{m}x{n} b{b}: syrk={syrk.backend} square={square.backend}"
        if not args.no_methods:
            entry = tune_method(m, n, b, dtype, device, coefficients=args.coefficients, steps=args.steps, cache_path=args.cache)
            times = ", ".join(f"{k} {v:.3f} ms" for k, v in entry["time_ms"].items())
            line += f" method={entry['method']} ({times})"
        print(f"{line}  [{time.time() - t0:.1f} s]", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
