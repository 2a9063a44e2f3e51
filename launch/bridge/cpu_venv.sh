#!/usr/bin/env bash
# A CPU venv (Python 3.11) where Megatron-Bridge 0.6.2's training path imports, for tests/megatron/bridge/test_adapter.py's Bridge tests:
#   bash launch/bridge/cpu_venv.sh [/tmp/bridge_venv] && PYTHONPATH=$PWD /tmp/bridge_venv/bin/python -m pytest tests/megatron/bridge/test_adapter.py
# Bridge declares Python >= 3.12, but every file of 0.6.2 compiles and imports on 3.11. Transformer Engine and
# diffusers are not installed: megatron_dmuon/testing/bridge_imports.py stands in for the two eager imports.
set -euo pipefail
V=${1:-${BRIDGE_VENV:-/tmp/bridge_venv}}
W=${BRIDGE_WHL_TMP:-/tmp/bw}; mkdir -p "$W"
python3 -m venv "$V"; source "$V/bin/activate"
pipq() { python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored: it is neither\|requires .*which is not installed\|dependency resolver\|dependency conflicts" || true; }
# 1) the repo's own CI recipe (launch/setup_env.sh): torch CPU wheel first, then mcore 0.19.2 without deps
pipq torch==2.13.0
pipq numpy "packaging>=24.2" triton mip psutil scipy pytest pytest-timeout matplotlib
pipq --no-deps --ignore-requires-python megatron-core==0.19.2
pipq --no-deps --ignore-requires-python emerging-optimizers==0.3.0 absl-py
python - <<'PY'
import os, site, sys
if sys.version_info < (3, 12):
    with open(os.path.join(site.getsitepackages()[0], "dmuon_typing_override.pth"), "w") as f:
        f.write("import typing, typing_extensions; typing.override = getattr(typing, 'override', typing_extensions.override)\n")
PY
# 2) Bridge itself (declares Python >=3.12,<3.13, but all its files compile and import on 3.11)
pipq --no-deps --ignore-requires-python megatron-bridge==0.6.2
# 3) HF stack with their deps (transformers 5.12.1 = Bridge's pin; 5.17.0 + tokenizers 0.23.2 also import fine)
pipq transformers==5.12.1 datasets==5.2.0 tensorboard requests
# 4) what the import chain needs, without deps
pipq --no-deps einops defusedxml nvidia-ml-py omegaconf==2.4.0 \
  megatron-energon==7.4.1 multi-storage-client==0.51.0 xattr==1.3.1 cffi lark==1.3.1 wcmatch==12.0.4 bracex==3.2.4 \
  jsonschema==4.26.0 referencing==0.37.0 rpds-py jsonschema-specifications opentelemetry-api==1.45.2 \
  braceexpand==0.1.7 rapidyaml==0.15.2 deprecation==2.1.0 filetype==1.2.0 webdataset==1.0.2 \
  nvidia-modelopt==0.47.0 pulp==3.3.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection attrs
# 5) nvidia-resiliency-ext: megatron-core 0.19.2 asserts nvrx >= 0.6.0 once nvrx is importable (0.4.1 crashes
#    `import megatron.core` with AttributeError: nvidia_resiliency_ext has no __version__). 0.6.0 ships only
#    manylinux_2_39 wheels and this machine has glibc 2.36, so install the cp311 wheel under a plain linux tag
#    (its only binary, nvrx_cupti_module*.so, is not loaded by the import path).
python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.11 \
  --platform manylinux_2_39_x86_64 -d "$W" nvidia-resiliency-ext==0.6.0 2>&1 | grep -v "is ignored" || true
cp "$W"/nvidia_resiliency_ext-0.6.0-cp311-cp311-manylinux_2_39_x86_64.whl "$W"/nvidia_resiliency_ext-0.6.0-cp311-cp311-linux_x86_64.whl
pipq --no-deps "$W"/nvidia_resiliency_ext-0.6.0-cp311-cp311-linux_x86_64.whl
echo "installed into $V"
