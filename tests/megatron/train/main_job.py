"""Real runs of the main job for the tests (python -m megatron_dmuon.testing.cpu_train under torchrun, gloo,
a tiny GPT) and what they read back: the summary line, the losses, a checkpoint's tensors. The runs that
several test files read are session fixtures in conftest.py beside this file."""
from __future__ import annotations

import json
import os
import shutil

import torch

from megatron_dmuon.testing.multiproc import run_main_job

JOB = ["-m", "megatron_dmuon.testing.cpu_train"]
SMALL = ["--seq-length", "32", "--hidden-size", "64", "--ffn-hidden-size", "128", "--global-batch-size", "8",
         "--micro-batch-size", "2", "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-iters", "1"]


def job(*argv, nproc=2, expect=0):
    """One 2-rank run, as torchrun runs it, on ranks forked from the tests' fork server
    (``testing.multiproc.run_main_job``); ``expect``: 0 (success), or the exit code a failing run must
    give (1: any non-zero, which is all torchrun says of a failed rank)."""
    proc = run_main_job([*SMALL, *map(str, argv)], nproc=nproc)
    ok = proc.returncode == 0 if expect == 0 else (proc.returncode != 0 if expect == 1 else proc.returncode == expect)
    assert ok, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def summary(proc) -> dict:
    line = next(l for l in proc.stdout.splitlines() if l.startswith("> summary "))
    return json.loads(line[len("> summary "):])


def losses(proc) -> dict:
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith(" iteration"):
            it = int(line.split()[1].split("/")[0])
            out[it] = line.split("lm loss: ")[1].split()[0]
    return out


def tensors(root, iteration) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(root, f"flat_{iteration}.pt")
    dcp_to_torch_save(os.path.join(root, f"iter_{iteration:07d}"), out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


def stop_at(src, dst, iteration):
    """A copy of checkpoint root ``src`` whose latest checkpoint is ``iteration``."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.pt", ".dmuon_save.lock"))
    for name in os.listdir(dst):
        if name.startswith("iter_") and int(name[5:]) > iteration:
            shutil.rmtree(os.path.join(dst, name))
    with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return dst


def same_tensors(a, b):
    assert set(a) == set(b)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:5]
