#!/usr/bin/env bash
# Sourced by run_tests.sh / run_main.sh: install (or reuse, after checking it) the venv quietly, then activate
# it. It leaves the working directory as it is: run_main.sh's relative paths are the user's.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
set +o pipefail
bash "$ROOT/launch/setup_env.sh" 2>&1 | { grep -v "is ignored: it is neither" || true; }
status=${PIPESTATUS[0]}
set -o pipefail
[ "$status" -eq 0 ] || { echo "environment set-up failed (launch/setup_env.sh)" >&2; exit "$status"; }
# shellcheck disable=SC1091
source "${DMUON_VENV:-$ROOT/.venv}/bin/activate"
