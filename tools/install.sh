#!/usr/bin/env bash
# Create (or reuse) .venv and install Tessel into it, editable, with its native extensions.
# torch is pinned and installed first: an unpinned torch would pull a multi-GB CUDA build,
# and the build runs without isolation so it compiles against exactly this torch.
# Usage: bash tools/install.sh [extra ...]   (extras: test, cute; default: test)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${*:-test}
EXTRAS=${EXTRAS// /,}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --disable-pip-version-check \
  "torch==2.13.0" "setuptools>=70" wheel "pybind11==3.1.0" "ninja==1.13.2" "numpy>=1.26"
# Editable install builds engine._* from csrc/ with ninja (about a minute on 2 cores).
MAX_JOBS=${MAX_JOBS:-2} "$VPY" -m pip install -q --disable-pip-version-check \
  --no-build-isolation -e ".[${EXTRAS}]"
"$VPY" -c "import engine, parallel, models; print('tessel installed:', engine.native_status())"
