# Sourced by .ci/run and the .ci/*_env.sh scripts: `ci_install ENV ARGS...` installs into the virtual environment ENV
# with uv's pip interface (uv pinned in .ci/constraints.txt, in .ci-deps/uv). Only the environments CI builds beside
# the tests' take it (axolotl's, the floors', the front ends', the wheel's torch): the tests' own environment is made
# with pip, as the README says. uv unpacks each wheel once into its cache (.ci-deps/uv-cache) and links it into every
# environment, where pip unpacked the same torch wheel into each of five environments and spent about two CPU
# minutes per environment. pip's find-links (where the CPU build of torch lies on the CI machine's disk) is
# passed on: uv does not read pip's configuration.
ci_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export UV_CACHE_DIR="${UV_CACHE_DIR:-$ci_root/.ci-deps/uv-cache}"
ci_uv="$ci_root/.ci-deps/uv/bin/uv"
ci_find_links="${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}"
ci_uv_ready() {  # once per checkout (.ci/run calls it before starting the environments beside the tests)
    if [ ! -x "$ci_uv" ]; then
        python3 -m venv "$ci_root/.ci-deps/uv"
        "$ci_root/.ci-deps/uv/bin/python" -m pip install -q -c "$ci_root/.ci/constraints.txt" uv
    fi
}
ci_install() {  # ci_install ENV ARGS...: `uv pip install ARGS` into ENV (a virtual environment made by python3 -m venv)
    local env=$1
    shift
    ci_uv_ready
    local links=()
    for dir in $ci_find_links; do
        links+=(--find-links "$dir")
    done
    "$ci_uv" pip install -q --python "$env/bin/python" "${links[@]}" "$@"
}
