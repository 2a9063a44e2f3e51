#!/usr/bin/env bash
# The main job: set up the venv, then pretrain a megatron-core GPT with DMuon via torchrun.
# CPU machine: 2 gloo ranks. GPU machine: one rank per GPU (NCCL), bf16.
# Extra arguments go to examples/pretrain_gpt.py (e.g. --train-iters 200 --optimizer adam).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/activate_env.sh"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
if python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  NPROC="${NPROC:-$(python -c 'import torch; print(torch.cuda.device_count())')}"
  EXTRA=(--bf16)
else
  NPROC="${NPROC:-2}"
  EXTRA=()
fi
exec torchrun --standalone --nproc-per-node "$NPROC" examples/pretrain_gpt.py "${EXTRA[@]}" "$@"
