#!/usr/bin/env bash
# The oldest versions lce_patch declares, in a virtual environment of their own, for the model and integration tests
# (.ci/run runs tests/models and tests/integrations there): the lower bounds pyproject.toml gives transformers,
# accelerate and the peft, trl and datasets extras, pinned exactly with everything else in
# .ci/floors-constraints.txt (written by .ci/pin.sh, which resolves them) and installed without resolving again
# (--no-deps). The tests run this checkout's lce_patch from the repository root (no install: the tests' own
# environment is installed from the same checkout at the same time).
set -euo pipefail
cd "$(dirname "$0")/.."
. .ci/uv.sh
env=.ci-deps/floors
python3 -m venv --without-pip "$env"
ci_install "$env" --no-deps -r .ci/floors-constraints.txt
"$env/bin/python" -m pip check
