#!/usr/bin/env bash
# infra/install-arctic.sh [VENV]   (default .venv; the README's set-up commands run it)
# Installs Arctic Inference, which vLLM's `suffix` drafting (`vllm_suffix`) needs, into VENV.
# PyPI has only its source release, whose build wants torch, cmake, ninja, nanobind, and
# grpcio-tools pinned to protobuf 5.29 (older than vLLM's). So the wheel is built once in a
# throwaway venv that sees VENV's torch (no second torch download), cached under
# $DRAFTLAB_CACHE/wheels, and installed into VENV without dependencies (its vLLM plugin stays
# off unless ARCTIC_INFERENCE_ENABLED is set; vLLM imports only its suffix trees).
set -euo pipefail
VERSION=0.3.0
venv=$(cd "${1:-.venv}" && pwd)
cache="${DRAFTLAB_CACHE:-$HOME/.cache/draftlab}/wheels"
if "$venv/bin/python" -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
    exit 0
fi
mkdir -p "$cache"
wheel=$(ls "$cache"/arctic_inference-"$VERSION"-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
    echo "+ building arctic-inference $VERSION (suffix decoding for vLLM; once, ~1 min)" >&2
    build=$(mktemp -d)
    trap 'rm -rf "$build"' EXIT
    "$venv/bin/python" -m venv "$build/venv"
    site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    own=$("$build/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$site" > "$own/zz-draftlab-venv.pth"  # after its own packages: torch from VENV, protobuf 5.29 its own
    "$build/venv/bin/pip" install -q --disable-pip-version-check setuptools wheel ninja cmake nanobind==2.9.2 \
        protobuf==5.29.6 grpcio-tools==1.71.2 >"$build/log" 2>&1 || { cat "$build/log"; exit 1; }
    # its CMake finds nanobind through `python` on PATH: the build venv's
    PATH="$build/venv/bin:$PATH" pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
        --no-binary arctic-inference -w "$cache" "arctic-inference==$VERSION" >>"$build/log" 2>&1 \
        || { cat "$build/log"; exit 1; }
    wheel=$(ls "$cache"/arctic_inference-"$VERSION"-*.whl | head -n 1)
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$wheel"
"$venv/bin/python" -c "import arctic_inference.suffix_decoding"
