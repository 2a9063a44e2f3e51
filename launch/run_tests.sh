#!/usr/bin/env bash
# The test command: creates/reuses .venv, installs everything, runs pytest.
# Extra arguments go to pytest (e.g. ./launch/run_tests.sh tests/algorithms/test_newton_schulz.py -x).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/activate_env.sh"
cd "$ROOT"  # pytest finds tests/ and setup.cfg from the checkout
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
