#!/usr/bin/env bash
# One command for a GPU machine: probes, the tests marked gpu and a short device benchmark,
# written to bench/results/gpu.json and bench/results/gpu_check.log (docs/gpu.md).
#
#   bench/gpu_check.sh            on a GPU machine (CuPy and a device), under 8 minutes
#   bench/gpu_check.sh --quick    the same tests, no tune step, a shorter benchmark: under 4
#   bench/gpu_check.sh --fake     on a CPU machine, against the strict fake runtime
#                                 (writes gpu_fake.json and gpu_check_fake.log)
#   PYTHON=python3 bench/gpu_check.sh --out DIR
#
# Installs nothing globally: the wheels brought in .whl/ go into a private folder that is
# put first on PYTHONPATH for this run only and removed at exit; the modules still missing
# are named with the wheel to bring. Each step has its own time limit inside the overall
# budget; a failing step is recorded and the rest still run (bench/gpu_check.py says what
# each step does). Stopped from outside (TERM, INT), the run still writes what it found.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
SITE="$(mktemp -d "${TMPDIR:-/tmp}/ringcomm-gpu-site.XXXXXX")" || exit 1
trap 'rm -rf "$SITE"' EXIT
# ringcomm_bench is bench/ under its installed name (pyproject's package-dir), for a tree
# that is not installed
ln -s "$ROOT/bench" "$SITE/ringcomm_bench"
export RINGCOMM_GPU_SITE="$SITE"
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# in the background, so that a TERM or INT reaches it as a TERM: it then stops its step,
# stops the MPS daemon it started and writes gpu.json before it ends
"$PYTHON" -m ringcomm_bench.gpu_check "$@" &
CHECK=$!
trap 'kill -TERM "$CHECK" 2>/dev/null' TERM INT
wait "$CHECK"
STATUS=$?
while kill -0 "$CHECK" 2>/dev/null; do  # a trapped signal ends `wait` early
    wait "$CHECK"
    STATUS=$?
done
exit "$STATUS"
