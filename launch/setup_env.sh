#!/usr/bin/env bash
# Create (or reuse) the project venv and install everything the tests and the main job need.
# Usage: bash launch/setup_env.sh  (then: source .venv/bin/activate)
# Why the order matters: torch must be installed before anything that depends on it, otherwise an
# unpinned `torch` requirement pulls a multi-GB CUDA build. megatron-core 0.19.x declares
# Python >= 3.12 but works on 3.11, so it is installed with --ignore-requires-python.
# A venv that was set up before is checked on every start (launch/check_env.py) and repaired.
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
want="$(cat "$ROOT/setup.cfg" "$ROOT/launch/setup_env.sh" "$ROOT/launch/check_env.py" | sha1sum | cut -c1-16)"
stale=0
[ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] || stale=1
# Reused only if whole: every package installed and each of its files there, megatron_dmuon from this
# checkout (launch/check_env.py: one Python start, no torch import). What it names is reinstalled; what
# is wrong is said when a venv that was set up before is damaged (not on a first install).
if [ "$stale" -eq 0 ]; then
  repairs="$(python "$ROOT/launch/check_env.py")" && whole=1 || whole=0
else
  repairs="$(python "$ROOT/launch/check_env.py" 2>/dev/null)" && whole=1 || whole=0
fi
if [ "$stale" -eq 1 ] || [ "$whole" -eq 0 ]; then
  [ "$stale" -eq 0 ] && echo "launch/setup_env.sh: $VENV is damaged (above): reinstalling what is missing or damaged" >&2
  rm -f "$STAMP"
  pip_q() { python -m pip install -q --disable-pip-version-check "$@"; }
  # torch first (its line comes first), then what is missing or damaged; megatron-core and Megatron's own
  # Muon (--dmuon-mode megatron_layerwise; tests/megatron/checkpoint/test_switch.py), emerging-optimizers, without
  # their dependencies and with --ignore-requires-python (both declare Python >= 3.12)
  while read -r -a args; do
    [ "${#args[@]}" -eq 0 ] || pip_q "${args[@]}"
  done <<< "$repairs"
  if [ "$stale" -eq 1 ]; then
    pip_q numpy "packaging>=24.2" triton mip psutil scipy einops pytest pytest-timeout matplotlib tensorboard wandb
  fi
  # On 3.11 emerging-optimizers lacks only typing.override (3.12's no-op marker), which megatron-core
  # imports through it at `import megatron.core`: this venv gets typing_extensions' at start-up (a .pth)
  python - <<'PY'
import os, site, sys
if sys.version_info < (3, 12):
    line = "import typing, typing_extensions; typing.override = getattr(typing, 'override', typing_extensions.override)\n"
    path = os.path.join(site.getsitepackages()[0], "dmuon_typing_override.pth")
    if not os.path.exists(path) or open(path).read() != line:
        with open(path, "w") as f:
            f.write(line)
PY
  [ "$stale" -eq 1 ] && pip_q --no-deps -e "$ROOT"
  if ! left="$(python "$ROOT/launch/check_env.py")"; then
    echo "launch/setup_env.sh: $VENV is still not whole after installing (above: $(echo "$left" | tr '\n' ' ')); " \
      "remove it (rm -rf $VENV) and run again" >&2
    exit 1
  fi
  echo "$want" > "$STAMP"
fi
export VENV
