#!/usr/bin/env bash
# axolotl in a virtual environment of its own (it pins torch, transformers, TRL and PEFT), for
# tests/integrations/test_axolotl.py, which runs this checkout's lce_patch there through PYTHONPATH.
# axolotl 0.19.0 is the newest release for Python 3.11.
set -euo pipefail
cd "$(dirname "$0")/.."
env=.ci-deps/axolotl
python3 -m venv "$env"
pins=.ci/axolotl-constraints.txt  # refreshed by .ci/pin.sh
"$env/bin/python" -m pip install -q -c "$pins" --upgrade pip
"$env/bin/python" -m pip install -q -c "$pins" torch  # the CPU build first, as for the main environment
AXOLOTL_DO_NOT_TRACK=1 "$env/bin/python" -m pip install -q -c "$pins" axolotl
