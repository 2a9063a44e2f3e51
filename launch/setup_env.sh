#!/usr/bin/env bash
# Create (or reuse) the project venv and install everything the tests and the main job need.
# Usage: bash launch/setup_env.sh  (then: source .venv/bin/activate)
# Why the order matters: torch must be installed before anything that depends on it, otherwise an
# unpinned `torch` requirement pulls a multi-GB CUDA build. megatron-core 0.19.x declares
# Python >= 3.12 but works on 3.11, so it is installed with --ignore-requires-python.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DMUON_VENV:-$ROOT/.venv}"
PY="${DMUON_PYTHON:-python3}"
TORCH_SPEC="${DMUON_TORCH:-torch==2.13.0}"
MCORE_SPEC="${DMUON_MCORE:-megatron-core==0.19.2}"
STAMP="$VENV/.dmuon-installed"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
want="$(cat "$ROOT/setup.cfg" "$ROOT/launch/setup_env.sh" | sha1sum | cut -c1-16)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  pip_q() { python -m pip install -q --disable-pip-version-check "$@"; }
  python -c "import torch" 2>/dev/null || pip_q "$TORCH_SPEC"
  pip_q numpy "packaging>=24.2" triton mip psutil scipy pytest pytest-timeout matplotlib
  python -c "import megatron.core" 2>/dev/null || pip_q --no-deps --ignore-requires-python "$MCORE_SPEC"
  # Megatron's own Muon (--dmuon-mode megatron_layerwise; tests/test_optimizer_switch.py). It declares
  # Python >= 3.12; on 3.11 it lacks only typing.override (3.12's no-op marker), which megatron-core
  # imports through it at `import megatron.core`: this venv gets typing_extensions' at start-up (a .pth)
  python -m pip show -q emerging-optimizers >/dev/null 2>&1 || pip_q --no-deps --ignore-requires-python \
    "${DMUON_EMERGING:-emerging-optimizers==0.3.0}" absl-py
  python - <<'PY'
import os, site, sys
if sys.version_info < (3, 12):
    with open(os.path.join(site.getsitepackages()[0], "dmuon_typing_override.pth"), "w") as f:
        f.write("import typing, typing_extensions; typing.override = getattr(typing, 'override', typing_extensions.override)\n")
PY
  pip_q --no-deps -e "$ROOT"
  echo "$want" > "$STAMP"
fi
export VENV
