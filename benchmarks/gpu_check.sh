#!/usr/bin/env bash
# The one-shot GPU check of issue 26 (benchmarks/gpu_check.py says what it prints).
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine: installs the tree + gpu_wheels/, then checks
#   bash benchmarks/gpu_check.sh --dry-run  # every phase on the CPU, tiny shapes, Triton interpreted (CI)
#
# The GPU machine has no network: the tree installs with --no-index --no-build-isolation, and
# what it lacks (fla-core, rwkv) comes as wheels in gpu_wheels/ (benchmarks/gpu_wheels.sh fetches
# them beforehand). Output goes to stdout and, where $OUT is set, to $OUT/gpu_check.log.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=0
ARGS=()
for a in "$@"; do
    if [ "$a" = "--dry-run" ]; then DRY=1; fi
    ARGS+=("$a")
done
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the tree itself, even where the install below fails
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-${TMPDIR:-/tmp}/gpu_check_torchext}"
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; fi
say() { echo "$*"; if [ -n "${OUT:-}" ]; then echo "$*" >>"$OUT/gpu_check.log"; fi; }

if [ "$DRY" = 1 ]; then
    # Triton kernels through the interpreter (set before anything imports them); the CPU's native
    # kernels are not what this checks, and their first build takes minutes.
    export TRITON_INTERPRET=1 RWKV_ENGINE_ISA="${RWKV_ENGINE_ISA:-none}"
    BUDGET=280
else
    unset TRITON_INTERPRET  # compiled kernels on the GPU, whatever the calling shell had
    # Guarded: a failed install is reported and the check runs from the tree (PYTHONPATH).
    say "== install: the working tree (no index, no build isolation)"
    if ! "$PY" -m pip install --quiet --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3; then
        say "   install of the tree failed; running from PYTHONPATH=$ROOT"
    fi
    if compgen -G "gpu_wheels/*.whl" >/dev/null; then
        say "== install: gpu_wheels/ ($(ls gpu_wheels/*.whl | xargs -n1 basename | tr '\n' ' '))"
        "$PY" -m pip install --quiet --no-deps --no-index gpu_wheels/*.whl 2>&1 | tail -3 || say "   wheel install failed"
    else
        say "== no gpu_wheels/ folder: fla and the rwkv peer will be missing (benchmarks/gpu_wheels.sh fetches them)"
    fi
    # The CPU reference of the parity phase runs the PyTorch modules (the specification): no native build.
    export RWKV_ENGINE_ISA="${RWKV_ENGINE_ISA:-none}"
    BUDGET=${GPU_CHECK_BUDGET:-440}
fi

# The check's own phases are guarded inside; this line's status is the number of failed phases > 0.
status=0
"$PY" benchmarks/gpu_check.py --budget "$BUDGET" ${ARGS[@]+"${ARGS[@]}"} || status=$?
exit "$status"
