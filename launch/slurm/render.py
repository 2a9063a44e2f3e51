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


MARK = "# rendered by launch/slurm/render.py"  # -o replaces only a file that holds this line
# Slurm's --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
# days-hours:minutes:seconds; or UNLIMITED / INFINITE
TIME_FORMATS = (r"\d+", r"\d+:[0-5]?\d", r"\d+:[0-5]?\d:[0-5]?\d", r"\d+-(?:[01]?\d|2[0-3])",
                r"\d+-(?:[01]?\d|2[0-3]):[0-5]?\d", r"\d+-(?:[01]?\d|2[0-3]):[0-5]?\d:[0-5]?\d")
# what an #SBATCH line takes as one value: no whitespace (the line would end there, or a newline
# would put the rest into the script body), no quotes, no shell metacharacters
NAME = re.compile(r"[A-Za-z0-9_.+,=@:-]+")
PATTERN = re.compile(r"[A-Za-z0-9_.+,=@:%/~-]+")  # --output: Slurm's %j, %x, %N ... and a path


def check_values(nodes: int, gpus_per_node: int, recipe: str, megatron_lm: str, *, job_name="dmuon",
                 time="04:00:00", cpus_per_task=None, output="dmuon-%j.out", partition=None, account=None) -> None:
    """ValueError naming the flag for every value Slurm, the #SBATCH lines or the job would take
    wrongly (a value with a space or a newline would cut its line and put the rest in the script)."""
    for flag, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node), ("--cpus-per-task", cpus_per_task)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{flag} must be a positive integer (got {value!r})")
    if recipe not in RECIPES:
        raise ValueError(f"--recipe {recipe!r} unknown; valid: {', '.join(RECIPES)}")
    if not (isinstance(time, str) and (time.upper() in ("UNLIMITED", "INFINITE")
                                       or any(re.fullmatch(f, time) for f in TIME_FORMATS))):
        raise ValueError(f"--time {time!r} is not a Slurm time: MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, "
                         "DAYS-HOURS, DAYS-HOURS:MINUTES or DAYS-HOURS:MINUTES:SECONDS (e.g. 04:00:00, 1-12:00:00)")
    for flag, value, pattern in (("--job-name", job_name, NAME), ("--partition", partition, NAME),
                                 ("--account", account, NAME), ("--output", output, PATTERN)):
        if value is not None and not (isinstance(value, str) and pattern.fullmatch(value)):
            raise ValueError(f"{flag} {value!r} cannot go on an #SBATCH line: use letters, digits and {'_.+,=@:-'}"
                             + (" (and % patterns, / for a folder)" if pattern is PATTERN else "")
                             + "; no spaces, newlines, quotes or shell characters")
    if any(c in megatron_lm for c in "\n\r\0"):
        raise ValueError(f"--megatron-lm {megatron_lm!r} holds a newline")
    missing = [f for f in ("pretrain_gpt.py", os.path.join("megatron", "training")) if not os.path.exists(
        os.path.join(megatron_lm, f))]
    if not os.path.isdir(megatron_lm) or missing:
        why = "does not exist" if not os.path.exists(megatron_lm) else (
            "is not a directory" if not os.path.isdir(megatron_lm) else f"has no {' and no '.join(missing)}")
        raise ValueError(f"--megatron-lm {megatron_lm} {why}: give a Megatron-LM checkout (git clone "
                         "NVIDIA/Megatron-LM; git checkout core_v0.19.0) on a filesystem the nodes share")


def render(nodes: int, gpus_per_node: int, recipe: str, megatron_lm: str, *, extra_args=(), job_name="dmuon",
           time="04:00:00", cpus_per_task=None, output="dmuon-%j.out", partition=None, account=None,
           dmuon_repo: str = REPO, template: str = TEMPLATE) -> str:
    """The sbatch script text; raises ValueError for values Slurm or torchrun would reject later
    (``check_values``)."""
    check_values(nodes, gpus_per_node, recipe, megatron_lm, job_name=job_name, time=time, cpus_per_task=cpus_per_task,
                 output=output, partition=partition, account=account)
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
    first, rest = text.split("\n", 1)
    return f"{first}\n{MARK}\n{rest}"


def out_problem(out: str, megatron_lm: str) -> "str | None":
    """Why ``-o OUT`` must not be written: a folder, a missing folder, the template or a recipe, a
    file in the Megatron-LM checkout, or any existing file this script did not render."""
    if os.path.isdir(out):
        return "is a directory"
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        return f"cannot be written: {folder} is not a directory"
    real = os.path.realpath(out)
    if real == os.path.realpath(TEMPLATE) or os.path.dirname(real) == os.path.realpath(os.path.join(REPO, "launch", "recipes")):
        return "is one of launch/'s own files (the template or a recipe)"
    if os.path.isdir(megatron_lm) and os.path.commonpath([real, os.path.realpath(megatron_lm)]) == os.path.realpath(megatron_lm):
        return f"is inside the Megatron-LM checkout {megatron_lm}"
    if os.path.exists(out):
        try:
            with open(out, errors="replace") as f:
                ours = MARK in f.read(4096).splitlines()
        except OSError as exc:
            return f"cannot be read ({exc.strerror})"
        if not ours:
            return "exists and was not written by render.py (no '" + MARK + "' line): it is left untouched"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True, help="also passed as --dmuon-ranks-per-node")
    p.add_argument("--recipe", required=True, choices=RECIPES)
    p.add_argument("--megatron-lm", required=True, help="Megatron-LM checkout (core_v0.19.0) on a shared filesystem")
    p.add_argument("--job-name", default="dmuon")
    p.add_argument("--time", default="04:00:00", help="Slurm's formats, e.g. 04:00:00 or 1-12:00:00 (default 4 h)")
    p.add_argument("--cpus-per-task", type=int, default=None, help="default: 8 per GPU")
    p.add_argument("--output", default="dmuon-%j.out", help="Slurm log file pattern")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("-o", "--out", default="-", help="where to write the script (- = stdout); an existing file "
                                                    "is replaced only if render.py wrote it")
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
        problem = out_problem(args.out, args.megatron_lm)
        if problem:
            p.error(f"-o {args.out} {problem}: choose another file")
        with open(args.out, "w") as f:
            f.write(text)
        os.chmod(args.out, 0o755)
    return 0


if __name__ == "__main__":
    sys.exit(main())
