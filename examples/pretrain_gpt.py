"""The main job moved into the package: ``python -m megatron_dmuon.megatron.train`` (``dmuon-train``)
on CUDA GPUs, ``python -m megatron_dmuon.testing.cpu_train`` on CPUs; ``launch/run_main.sh`` picks.

This path stays for the scripts that still name it (bench/); it picks the entry as run_main.sh does.
"""
import torch


def main(argv=None) -> None:
    if torch.cuda.is_available():
        from megatron_dmuon.megatron.train.job import main as train
    else:
        from megatron_dmuon.testing.cpu_train import main as train
    train(argv)


if __name__ == "__main__":
    main()
