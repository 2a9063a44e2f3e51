"""``python -m megatron_dmuon.megatron.train`` / ``dmuon-train``: the main job on CUDA GPUs.

Off CUDA megatron-core's hard-coded CUDA calls need the test CPU shim, which production code does
not import: CPU runs start ``python -m megatron_dmuon.testing.cpu_train`` (launch/run_main.sh picks).
"""
from __future__ import annotations

import os
import sys

import torch

from .checks import PROG

CPU_ENTRY = "python -m megatron_dmuon.testing.cpu_train"


def main(argv=None) -> None:
    if not torch.cuda.is_available():
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{PROG}: error: no CUDA device here; this entry runs on GPUs. On CPUs run "
                             f"{CPU_ENTRY} (same flags), or launch/run_main.sh, which picks the entry\n")
        raise SystemExit(2)
    from .job import main as train_main

    train_main(argv)


if __name__ == "__main__":
    main()
