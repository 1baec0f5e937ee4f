#!/usr/bin/env bash
# Installs mpress (and, with --dev, the test tools) into the current Python.
# Installs the CPU build torch==2.13.0 first when torch is absent: the plain `torch`
# requirement would pull several GB of CUDA packages. On a GPU machine, install the
# CUDA torch you want before running this script and it is left alone.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
extras=""
[[ "${1:-}" == "--dev" ]] && extras="[dev]"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "setup: torch not found, installing the CPU build torch==2.13.0"
    "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".${extras}"
echo "setup: mpress installed ($("$PY" -c 'import mpress, torch; print("mpress", mpress.__version__, "torch", torch.__version__)'))"
