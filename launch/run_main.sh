#!/usr/bin/env bash
# The main job: set up the venv, then pretrain a megatron-core GPT with DMuon via torchrun.
# GPU machine: one rank per GPU (NCCL), bf16, python -m megatron_dmuon.megatron.train. CPU machine: 2 gloo
# ranks, python -m megatron_dmuon.testing.cpu_train (the same trainer after the test CPU shim, which
# megatron-core's hard-coded CUDA calls need and production code never imports).
# Extra arguments go to the trainer (e.g. --train-iters 200 --optimizer adam).
# The arguments are checked once, in one process, before torchrun starts: a usage error prints one
# message and exits 2 (under torchrun every rank would fail and torchrun add its own report).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck disable=SC1091
source "$HERE/activate_env.sh"  # keeps the directory: relative --save, --data-path, --timing-json are the user's
# Megatron's and torch's notices (UserWarning, DeprecationWarning, FutureWarning) are off; DMuon's own
# warnings (RuntimeWarning: a corrupt cache, a kernel fallback, profiling cut short) stay visible
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::UserWarning,ignore::DeprecationWarning,ignore::FutureWarning}"
# one Python process picks the entry (CUDA GPUs or CPU ranks) and checks the arguments: launch/precheck.py
checked="$(python "$HERE/precheck.py" "$@")"  # a usage error: its message, exit 2 (set -e)
choice="${checked##*$'\n'}"
if [ "${choice#run: }" = "$choice" ]; then
  printf '%s\n' "$checked"  # -h / --help: the help, printed once; no run
  exit 0
fi
read -r NPROC ENTRY EXTRA <<< "${choice#run: }"
# a run-time error of the job prints one block: torchrun's own report of the failed children is dropped
# after it; the runner ends when torchrun ends (not when every process holding its stderr does) and
# exits with torchrun's status (1 for any failed child); a signal to it (Ctrl-C, kill -INT/-TERM/-HUP) is passed on
# to torchrun, which stops the ranks: exit 128 + the signal; launch/after_job_error.py
# shellcheck disable=SC2086
exec python -u "$HERE/after_job_error.py" torchrun --standalone --nproc-per-node "$NPROC" -m "$ENTRY" $EXTRA "$@"
