#!/usr/bin/env bash
# One command on a lent GPU machine: every GPU-only check of jetflow_pl, results in one JSON file.
#
#   bash scripts/gpu_check.sh                      # full run (<= 8 minutes on one H200)
#   bash scripts/gpu_check.sh --quick              # fewer shapes
#   bash scripts/gpu_check.sh --only triton_numerics timing
#   bash scripts/gpu_check.sh --dry-run            # CPU: walks every step, records why each is skipped
#
# Why a wrapper: it fixes the working directory and PYTHONPATH (the repository need not be installed),
# and puts a hard 8-minute cap around the Python orchestrator (which also keeps its own, smaller budget
# and writes its JSON after every step, so a killed run still leaves what it measured).
# See docs/GPU_CHECK.md.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if command -v python >/dev/null 2>&1; then PY=python; else PY=python3; fi
fi

echo "[gpu_check.sh] $(date -u +%FT%TZ) repo=$PWD python=$(command -v "$PY")"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
else
  echo "[gpu_check.sh] nvidia-smi not found"
fi

HARD_LIMIT_S="${GPU_CHECK_HARD_LIMIT_S:-475}"
timeout --kill-after=10 "$HARD_LIMIT_S" "$PY" scripts/gpu_check.py "$@"
rc=$?
if [[ $rc -eq 124 || $rc -eq 137 ]]; then
  echo "[gpu_check.sh] killed at the hard limit of ${HARD_LIMIT_S} s; partial results are in the --out JSON"
fi
exit $rc
