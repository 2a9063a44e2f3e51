"""Render launch/slurm/megatron_lm.sbatch for a cluster: nodes, GPUs per node, recipe, checkout.

    python launch/slurm/render.py --nodes 2 --gpus-per-node 8 --recipe qwen2.5_7b \
        --megatron-lm /path/to/Megatron-LM --partition gpu -o job.sbatch -- --save /ckpt
    sbatch job.sbatch

Everything after `--` is appended to Megatron-LM's command line (shell-quoted). Standard library
only, so it runs on any login node.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TEMPLATE = os.path.join(HERE, "megatron_lm.sbatch")
RECIPES = sorted(f[:-3] for f in os.listdir(os.path.join(REPO, "launch", "recipes")) if f.endswith(".sh"))


def render(nodes: int, gpus_per_node: int, recipe: str, megatron_lm: str, *, extra_args=(), job_name="dmuon",
           time="04:00:00", cpus_per_task=None, output="dmuon-%j.out", partition=None, account=None,
           dmuon_repo: str = REPO, template: str = TEMPLATE) -> str:
    """The sbatch script text; raises ValueError for values Slurm or torchrun would reject later."""
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"--nodes ({nodes}) and --gpus-per-node ({gpus_per_node}) must be >= 1")
    if recipe not in RECIPES:
        raise ValueError(f"--recipe {recipe!r} unknown; valid: {', '.join(RECIPES)}")
    extra = [f"#SBATCH --{k}={v}" for k, v in (("partition", partition), ("account", account)) if v]
    values = {
        "JOB_NAME": job_name, "NODES": str(nodes), "GPUS_PER_NODE": str(gpus_per_node),
        "CPUS_PER_TASK": str(cpus_per_task or 8 * gpus_per_node), "TIME": time, "OUTPUT": output,
        "RECIPE": shlex.quote(recipe), "MEGATRON_LM": shlex.quote(os.path.abspath(megatron_lm)),
        "DMUON_REPO": shlex.quote(os.path.abspath(dmuon_repo)),
        "EXTRA_ARGS": " ".join(shlex.quote(a) for a in extra_args),
    }
    text = open(template).read()
    text = text.replace("# @SBATCH_EXTRA@\n", "".join(line + "\n" for line in extra))
    text = re.sub(r"@([A-Z_]+)@", lambda m: values[m.group(1)], text)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True, help="also passed as --dmuon-ranks-per-node")
    p.add_argument("--recipe", required=True, choices=RECIPES)
    p.add_argument("--megatron-lm", required=True, help="Megatron-LM checkout (core_v0.19.0) on a shared filesystem")
    p.add_argument("--job-name", default="dmuon")
    p.add_argument("--time", default="04:00:00")
    p.add_argument("--cpus-per-task", type=int, default=None, help="default: 8 per GPU")
    p.add_argument("--output", default="dmuon-%j.out", help="Slurm log file pattern")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("-o", "--out", default="-", help="where to write the script (- = stdout)")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then Megatron-LM flags to append")
    args = p.parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    try:
        text = render(args.nodes, args.gpus_per_node, args.recipe, args.megatron_lm, extra_args=extra,
                      job_name=args.job_name, time=args.time, cpus_per_task=args.cpus_per_task,
                      output=args.output, partition=args.partition, account=args.account)
    except ValueError as e:
        p.error(str(e))
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
        os.chmod(args.out, 0o755)
    return 0


if __name__ == "__main__":
    sys.exit(main())
