#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -m pytest "${@:--q}"
rc=$?
# pytest exits 5 when it collected no tests: report it rather than pass silently.
if [ "$rc" -eq 5 ]; then echo "no tests were collected"; exit 1; fi
exit "$rc"
