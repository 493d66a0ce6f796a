#!/usr/bin/env bash
# Regenerate requirements.lock: every dependency of turbonode[worker,test] pinned with its hashes,
# for Debian's python3 (3.11) on Linux, torch left out (scripts/setup.sh installs its CPU wheel
# first). Run after changing a dependency in pyproject.toml, then commit both files:
#   bash scripts/lock.sh            # keeps every pin that still fits pyproject.toml
#   bash scripts/lock.sh --upgrade  # takes the newest releases that fit (run the suite after)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/versions.sh
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
python3 -m venv "$tools"
"$tools/bin/pip" install -q --disable-pip-version-check "uv==$UV_VERSION"
echo "torch==$TORCH_VERSION" > "$tools/constraints.txt"
"$tools/bin/uv" pip compile pyproject.toml --extra worker --extra test \
    --python-version 3.11 --python-platform linux --generate-hashes \
    --constraints "$tools/constraints.txt" --no-emit-package torch \
    --custom-compile-command "bash scripts/lock.sh" -o requirements.lock "$@"
