#!/usr/bin/env bash
# The test command: creates/reuses .venv, installs everything, runs pytest.
# Extra arguments go to pytest (e.g. ./launch/run_tests.sh tests/test_newton_schulz.py -x).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
set +o pipefail
bash "$ROOT/launch/setup_env.sh" 2>&1 | { grep -v "is ignored: it is neither" || true; }
status=${PIPESTATUS[0]}
set -o pipefail
[ "$status" -eq 0 ] || { echo "environment set-up failed (launch/setup_env.sh)" >&2; exit "$status"; }
source "${DMUON_VENV:-$ROOT/.venv}/bin/activate"
cd "$ROOT"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::UserWarning}"
set +e
python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests (exit 5): treating as failure of the suite" >&2
  exit 1
fi
exit "$rc"
