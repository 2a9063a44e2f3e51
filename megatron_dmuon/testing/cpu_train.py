"""The main job on CPU ranks (gloo): installs the CPU shim, then runs the package trainer's ``main``.

    torchrun --nproc-per-node 2 -m megatron_dmuon.testing.cpu_train ARGS   # launch/run_main.sh picks it off CUDA

megatron-core hard-codes CUDA calls; the shim (cpu_shim.py) sends them to the CPU. It lives in
testing/, which production code never imports, so the trainer's own entry (``python -m
megatron_dmuon.megatron.train``, ``dmuon-train``) runs on GPUs only.
"""
from __future__ import annotations


def main(argv=None) -> None:
    from megatron_dmuon.megatron.train.job import main as train_main
    from megatron_dmuon.testing import cpu_shim

    cpu_shim.install()
    train_main(argv)


if __name__ == "__main__":
    main()
