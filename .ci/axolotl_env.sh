#!/usr/bin/env bash
# axolotl in a virtual environment of its own (it pins torch, transformers, TRL and PEFT), for
# tests/integrations/test_axolotl.py, which runs this checkout's lce_patch there through PYTHONPATH.
# axolotl 0.19.0 is the newest release for Python 3.11.
set -euo pipefail
cd "$(dirname "$0")/.."
. .ci/uv.sh
env=.ci-deps/axolotl
pins=.ci/axolotl-constraints.txt  # refreshed by .ci/pin.sh
python3 -m venv --without-pip "$env"
# torch named beside axolotl so that its pin (the CPU build) is the one taken; pip and setuptools at their pins
AXOLOTL_DO_NOT_TRACK=1 ci_install "$env" -c "$pins" pip setuptools torch axolotl
