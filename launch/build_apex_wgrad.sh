#!/usr/bin/env bash
# Build Apex's `fused_weight_gradient_mlp_cuda` alone (what Megatron-LM's default
# --gradient-accumulation-fusion needs for its non-TE output layer) from a checkout of NVIDIA/apex,
# without installing the rest of Apex (its PyPI name belongs to another project):
#
#   git clone --depth 1 https://github.com/NVIDIA/apex /path/to/apex      # (any recent commit)
#   launch/build_apex_wgrad.sh /path/to/apex DEST [CUDA_ARCH]              # then: export PYTHONPATH=DEST:$PYTHONPATH
#
# Needs nvcc and torch's C++ extension tool chain on the GPU machine; CUDA_ARCH defaults to the
# first GPU's (e.g. 90 on an H100/H200). About a minute. Nothing of Apex is kept in this repository.
set -euo pipefail
APEX=${1:?usage: build_apex_wgrad.sh APEX_CHECKOUT DEST [CUDA_ARCH]}; DEST=${2:?DEST}
APEX=$(cd "$APEX" && pwd); mkdir -p "$DEST"; DEST=$(cd "$DEST" && pwd)
ARCH=${3:-$(python3 -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}{n}')")}
for f in csrc/megatron/fused_weight_gradient_dense.cpp csrc/megatron/fused_weight_gradient_dense_cuda.cu \
         csrc/megatron/fused_weight_gradient_dense_16bit_prec_cuda.cu csrc/type_shim.h; do
  [ -f "$APEX/$f" ] || { echo "build_apex_wgrad.sh: $APEX/$f not found: is $APEX a checkout of NVIDIA/apex?" >&2; exit 2; }
done
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
cat > "$W/setup.py" <<PY
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension
src = "$APEX/csrc/megatron/"
setup(name="fused_weight_gradient_mlp_cuda", ext_modules=[CUDAExtension(
    "fused_weight_gradient_mlp_cuda",
    [src + "fused_weight_gradient_dense.cpp", src + "fused_weight_gradient_dense_cuda.cu",
     src + "fused_weight_gradient_dense_16bit_prec_cuda.cu"],
    include_dirs=["$APEX/csrc"],
    extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math", "-gencode",
                                                "arch=compute_${ARCH},code=sm_${ARCH}"]})],
    cmdclass={"build_ext": BuildExtension})
PY
(cd "$W" && MAX_JOBS=${MAX_JOBS:-8} python3 setup.py -q build_ext --build-lib "$DEST" > "$W/build.log" 2>&1) \
  || { tail -30 "$W/build.log"; echo "build_apex_wgrad.sh: the build failed (log above)" >&2; exit 1; }
PYTHONPATH="$DEST${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import torch, fused_weight_gradient_mlp_cuda as m; print('fused_weight_gradient_mlp_cuda built:', m.__file__)"
