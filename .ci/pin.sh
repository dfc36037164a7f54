#!/usr/bin/env bash
# Refresh CI's pins: `bash .ci/pin.sh`, then `bash .ci/run`, then commit the files it writes.
#
# CI installs every tool and library from these files, so its result depends on the code, not on the day:
#   .ci/constraints.txt           the tests', docs' and packaging environment (and the installed wheel's)
#   .ci/axolotl-constraints.txt   axolotl's own environment (tests/integrations/test_axolotl.py)
#   .ci/llamafactory-constraints.txt, .ci/swift-constraints.txt   LLaMA-Factory's and ms-swift's, installed from them
#                                 exactly (.ci/frontend_env.sh; tests/integrations/test_llamafactory.py, test_swift.py)
#   .ci/floors-constraints.txt    the oldest versions pyproject.toml declares (.ci/floors_env.sh)
# This script resolves, in scratch environments, the newest versions the package index serves today for what
# .ci/run installs, and writes them there. The versions held below stay as they are until changed here.
# Users install from pyproject.toml's ranges; `pip install -e ".[docs]" -c .ci/constraints.txt` gives them the
# docs toolchain CI builds with.
set -euo pipefail
cd "$(dirname "$0")/.."

torch_version=2.13.0       # the CPU build on the CI machine's disk
deepspeed_version=0.19.8   # the ZeRO checks on CPU processes
bitsandbytes_version=0.50.2
axolotl_version=0.19.0     # the newest release for Python 3.11
llamafactory_version=0.9.5
torchaudio_version=2.11.1  # the newest; LLaMA-Factory imports it (.ci/frontend_env.sh)
swift_version=4.6.0        # ms-swift
uv_version=0.13.9          # installs the environments beside the tests' (.ci/uv.sh)

export PIP_NO_CACHE_DIR=1
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

header() {
    echo "# Written by .ci/pin.sh on $(date -u +%Y-%m-%d) (Python $(python3 -c 'import platform; print(platform.python_version())')); do not edit by hand."
}

# The tests', docs' and packaging environment.
python3 -m venv "$scratch/main"
py="$scratch/main/bin/python"
"$py" -m pip install -q --upgrade pip setuptools wheel
"$py" -m pip install -q "torch==$torch_version"
"$py" -m pip install -q --no-build-isolation -e ".[test,docs]" "bitsandbytes==$bitsandbytes_version" build \
    "uv==$uv_version"
# DeepSpeed and its runtime needs go to a folder of their own in CI; resolve them in the same environment.
DS_BUILD_OPS=0 "$py" -m pip install -q --no-deps --no-build-isolation --target "$scratch/deepspeed" \
    "deepspeed==$deepspeed_version" hjson einops msgpack py-cpuinfo ninja pydantic pydantic-core annotated-types \
    typing-inspection
{
    header
    {
        "$py" -m pip freeze --all --exclude-editable
        for info in "$scratch"/deepspeed/*.dist-info; do
            "$py" - "$info" <<'EOF'
import email.parser, pathlib, sys
meta = email.parser.Parser().parsestr((pathlib.Path(sys.argv[1]) / "METADATA").read_text())
print(f"{meta['Name']}=={meta['Version']}")
EOF
        done
    } | sort -fu
} > .ci/constraints.txt

# axolotl's environment: it pins its own torch stack; everything else it pulls is pinned here.
python3 -m venv "$scratch/axolotl"
ax="$scratch/axolotl/bin/python"
"$ax" -m pip install -q --upgrade pip
"$ax" -m pip install -q "torch==$torch_version"
AXOLOTL_DO_NOT_TRACK=1 "$ax" -m pip install -q "axolotl==$axolotl_version"
{
    header
    "$ax" -m pip freeze --all | sort -f
} > .ci/axolotl-constraints.txt

# The floors' environment (.ci/floors_env.sh): the lower bounds pyproject.toml declares for transformers, accelerate,
# peft, trl and datasets, pinned exactly, with the test tools at the versions pinned above.
python3 -m venv "$scratch/floors"
fl="$scratch/floors/bin/python"
"$fl" -m pip install -q --upgrade pip setuptools wheel
"$fl" -m pip install -q "torch==$torch_version"
floors=$("$fl" - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
for requirement in project["dependencies"] + extras["peft"] + extras["trl"]:
    floor = re.fullmatch(r"(transformers|accelerate|peft|trl|datasets)>=([0-9.]+)", requirement.strip())
    if floor:
        print(f"{floor[1]}=={floor[2]}")
PY
)
tools=$(grep -iE '^(pytest|pytest-xdist|hypothesis|requests|triton)==' .ci/constraints.txt)
# shellcheck disable=SC2086 # one requirement a word
"$fl" -m pip install -q $floors $tools
{
    header
    "$fl" -m pip freeze --all | sort -f
} > .ci/floors-constraints.txt

# LLaMA-Factory's environment (.ci/frontend_env.sh llamafactory): its requirements beside the CPU torch, less
# torchvision (not imported by text SFT) and torchaudio (installed alone: no release is built for this torch; see
# .ci/frontend_env.sh).
python3 -m venv "$scratch/llamafactory"
lf="$scratch/llamafactory/bin/python"
"$lf" -m pip install -q --upgrade pip
"$lf" -m pip install -q "torch==$torch_version"
"$lf" -m pip install -q --no-deps "llamafactory==$llamafactory_version" "torchaudio==$torchaudio_version"
"$lf" - > "$scratch/llamafactory-requirements.txt" <<'PY'
import importlib.metadata, re
for requirement in importlib.metadata.requires("llamafactory"):
    name = re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower()
    if "extra ==" not in requirement and name not in ("torch", "torchaudio", "torchvision"):
        print(requirement)
PY
"$lf" -m pip install -q "torch==$torch_version" -r "$scratch/llamafactory-requirements.txt"
{
    header
    "$lf" -m pip freeze --all | sort -f
} > .ci/llamafactory-constraints.txt

# ms-swift's environment (.ci/frontend_env.sh swift): it asks for no torch; the CPU one first.
python3 -m venv "$scratch/swift"
sw="$scratch/swift/bin/python"
"$sw" -m pip install -q --upgrade pip
"$sw" -m pip install -q "torch==$torch_version"
"$sw" -m pip install -q "ms-swift==$swift_version"
{
    header
    "$sw" -m pip freeze --all | sort -f
} > .ci/swift-constraints.txt

echo "wrote .ci/constraints.txt ($(grep -vc '^#' .ci/constraints.txt) pins) and .ci/axolotl-constraints.txt ($(grep -vc '^#' .ci/axolotl-constraints.txt) pins)"
echo "wrote .ci/floors-constraints.txt ($(grep -vc '^#' .ci/floors-constraints.txt) pins)"
for name in llamafactory swift; do
    echo "wrote .ci/$name-constraints.txt ($(grep -vc '^#' ".ci/$name-constraints.txt") pins)"
done
