#!/usr/bin/env bash
# README's test command: install everything into .venv, then run the whole suite.
# Extra arguments go to pytest (e.g. bash tools/test.sh -k mesh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh test
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing (exit 5 must never pass silently)" >&2
  exit 1
fi
exit "$rc"
