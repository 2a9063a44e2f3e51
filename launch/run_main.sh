#!/usr/bin/env bash
# The main job: set up the venv, then pretrain a megatron-core GPT with DMuon via torchrun.
# GPU machine: one rank per GPU (NCCL), bf16, python -m megatron_dmuon.megatron.train. CPU machine: 2 gloo
# ranks, python -m megatron_dmuon.testing.cpu_train (the same trainer after the test CPU shim, which
# megatron-core's hard-coded CUDA calls need and production code never imports).
# Extra arguments go to the trainer (e.g. --train-iters 200 --optimizer adam).
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
  ENTRY=megatron_dmuon.megatron.train
else
  NPROC="${NPROC:-2}"
  EXTRA=()
  ENTRY=megatron_dmuon.testing.cpu_train
fi
WORLD_SIZE="$NPROC" LOCAL_WORLD_SIZE="$NPROC" python -m "$ENTRY" "${EXTRA[@]}" "$@" --parse-only >/dev/null
# a run-time error of the job prints one block: torchrun's own report of the failed children is dropped
# after it (launch/after_job_error.py); the exit code is torchrun's (1 for any failed child)
exec 3>&1
set +e
torchrun --standalone --nproc-per-node "$NPROC" -m "$ENTRY" "${EXTRA[@]}" "$@" 2>&1 1>&3 3>&- \
  | python -u "$(dirname "${BASH_SOURCE[0]}")/after_job_error.py"
status=${PIPESTATUS[0]}
exec 3>&-
exit "$status"
