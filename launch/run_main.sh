#!/usr/bin/env bash
# The main job: set up the venv, then pretrain a megatron-core GPT with DMuon via torchrun.
# CPU machine: 2 gloo ranks. GPU machine: one rank per GPU (NCCL), bf16.
# Extra arguments go to examples/pretrain_gpt.py (e.g. --train-iters 200 --optimizer adam).
# The arguments are checked once, in one process, before torchrun starts: a usage error prints one
# message and exits 2 (under torchrun every rank would fail and torchrun add its own report).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/activate_env.sh"
# Megatron's and torch's notices (UserWarning, DeprecationWarning, FutureWarning) are off; DMuon's own
# warnings (RuntimeWarning: a corrupt cache, a kernel fallback, profiling cut short) stay visible
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::UserWarning,ignore::DeprecationWarning,ignore::FutureWarning}"
if python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  NPROC="${NPROC:-$(python -c 'import torch; print(torch.cuda.device_count())')}"
  EXTRA=(--bf16)
else
  NPROC="${NPROC:-2}"
  EXTRA=()
fi
WORLD_SIZE="$NPROC" LOCAL_WORLD_SIZE="$NPROC" python examples/pretrain_gpt.py "${EXTRA[@]}" "$@" --parse-only >/dev/null
exec torchrun --standalone --nproc-per-node "$NPROC" examples/pretrain_gpt.py "${EXTRA[@]}" "$@"
