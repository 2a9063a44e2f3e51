"""The project's main job, the trainer: pretrain a megatron-core GPT with DMuon or Megatron's AdamW.

    python -m megatron_dmuon.megatron.train ARGS      # CUDA GPUs (under torchrun); the console script dmuon-train
    python -m megatron_dmuon.testing.cpu_train ARGS   # CPU ranks (gloo), through the test CPU shim
    ./launch/run_main.sh ARGS                         # picks one of the two

args.py (flags) -> checks.py (checked before anything is built) -> job.py (set-up, ``main``) ->
loop.py (the iterations) -> summary.py (what it prints and writes); data.py (tokens),
checkpoints.py (--save/--load).
"""
