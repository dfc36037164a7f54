#!/usr/bin/env bash
# A front end's virtual environment, for its tests under tests/integrations/: `bash .ci/frontend_env.sh NAME` builds
# .ci-deps/NAME with exactly the packages pinned in .ci/NAME-constraints.txt (written by .ci/pin.sh, which resolves
# them), installed without resolving again (--no-deps): the set is complete, and a resolver would only ask for
# what .ci/pin.sh leaves out on purpose. The tests run this checkout's lce_patch there through PYTHONPATH.
#   llamafactory  LLaMA-Factory 0.9.5 (tests/integrations/test_llamafactory.py)
#   swift         ms-swift 4.6 (tests/integrations/test_swift.py)
set -euo pipefail
cd "$(dirname "$0")/.."
. .ci/uv.sh
name=$1
env=.ci-deps/$name
pins=.ci/$name-constraints.txt
python3 -m venv --without-pip "$env"
ci_install "$env" --no-deps -r "$pins"
if [ "$name" = llamafactory ]; then
    # LLaMA-Factory imports torchaudio (for audio data) in the module every template imports, and asks for torchvision.
    # No torchaudio release is built for the CPU torch on the CI machine's disk, and PyPI's builds link CUDA
    # libraries that the CPU torch lacks, so its compiled extension fails to load; without its library files
    # torchaudio imports as pure Python (its documented case of an extension not found), which text SFT never
    # goes past. torchvision is left out: text SFT does not import it, and transformers works without it.
    rm -f "$env"/lib/python3*/site-packages/torchaudio/lib/*.so
fi
"$env/bin/python" -m pip check || true  # for the log: what pip misses (torchvision, the CPU torch's pairing)
