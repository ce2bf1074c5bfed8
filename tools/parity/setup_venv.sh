#!/usr/bin/env bash
# The kvpress side of `make parity`: its own virtualenv, because kvpress 0.5.5 pins transformers < 5.3 and the
# harness runs a newer transformers. torch 2.13.0 goes in first (the CPU wheel on a CPU machine) and is then held
# by a constraint, so kvpress's dependencies can neither upgrade it nor pull a CUDA build.
# Usage: tools/parity/setup_venv.sh [VENV]   (default .parity-venv; rerunning is a no-op once it is complete)
set -euo pipefail
VENV=${1:-.parity-venv}
STAMP="$VENV/.kvpress-0.5.5"
if [ -e "$STAMP" ]; then exit 0; fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
CONSTRAINTS="$VENV/constraints.txt"
echo "torch==2.13.0" > "$CONSTRAINTS"
"$VENV/bin/pip" install -q -c "$CONSTRAINTS" kvpress==0.5.5
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch
assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__}: the parity venv needs 2.13.0"
print(f"parity venv: kvpress {md.version('kvpress')}, transformers {md.version('transformers')}, torch {torch.__version__}")
PY
"$VENV/bin/pip" freeze > "$VENV/freeze.txt"
touch "$STAMP"
