#!/usr/bin/env bash
# Set up (scripts/setup.sh), check lint, format and types, then run the whole test suite.
# Extra arguments go to pytest. Any failing step fails the run.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
echo "[test] ruff check" && .venv/bin/ruff check . || exit 1
echo "[test] ruff format --check" && .venv/bin/ruff format --check . || exit 1
echo "[test] mypy" && .venv/bin/mypy || exit 1
.venv/bin/python -m pytest "${@:--q}"
rc=$?
# pytest exits 5 when it collected no tests: report it rather than pass silently.
if [ "$rc" -eq 5 ]; then echo "no tests were collected"; exit 1; fi
exit "$rc"
