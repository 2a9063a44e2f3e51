# Source on a GPU machine (the device tool's H200): megatron-core and the other wheels in .whl,
# Transformer Engine from .te (an sm_90 build of TE 2.20.2 with its install.sh: docs/megatron_lm.md §10), and Apex's
# fused_weight_gradient_mlp_cuda from .apex (an NVIDIA/apex checkout, or its four csrc files) when
# present. Sets PYTHONPATH (repository first) and the environment every GPU command here uses.
#   source tests/gpu/setup_h200.sh            # idempotent: ~20 s on a machine that has run it
_here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export SITE=${SITE:-/tmp/site} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 DMUON_AUTOTUNE_CACHE=${DMUON_AUTOTUNE_CACHE:-/tmp/dmuon_autotune.json}
mkdir -p "$SITE"
if ls "$_here"/.whl/*.whl >/dev/null 2>&1 && [ ! -e "$SITE/.dmuon_whl_done" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$_here"/.whl/*.whl \
    && touch "$SITE/.dmuon_whl_done"
fi
# Optional: Emerging-Optimizers 0.4.0 (Megatron's --muon-use-syrk needs it) over .whl's 0.3.0 where .whl_eo040 holds
# its wheel (made here: docs/megatron_lm.md §1); after .whl's install, with a marker of its own
if ls "$_here"/.whl_eo040/*.whl >/dev/null 2>&1 && [ ! -e "$SITE/.dmuon_eo040_done" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --ignore-requires-python --target "$SITE" \
    "$_here"/.whl_eo040/*.whl && touch "$SITE/.dmuon_eo040_done"
fi
if [ -d "$_here/.te" ]; then
  source "$_here/.te/install.sh" || echo "setup_h200.sh: Transformer Engine did not install (the TE tests will skip)" >&2
fi
if [ -d "$_here/.apex" ]; then
  if ! PYTHONPATH=/tmp/apex_wgrad python3 -c "import torch, fused_weight_gradient_mlp_cuda" >/dev/null 2>&1; then
    bash "$_here/launch/build_apex_wgrad.sh" "$_here/.apex" /tmp/apex_wgrad || echo "setup_h200.sh: Apex wgrad build failed" >&2
  fi
  export PYTHONPATH=/tmp/apex_wgrad:$PYTHONPATH
fi
export PYTHONPATH=$_here:$SITE${PYTHONPATH:+:$PYTHONPATH}
