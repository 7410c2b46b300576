#!/usr/bin/env bash
# The GPU path on a real NVIDIA GPU, in one go (issue 16). CI has no GPU and runs the strict
# stand-in (TINYTRAIN_DEVICE=strict, see .ci/run); this script is what proves the real thing.
#
#   pip install -e ".[gpu]"          # CuPy; add torch with CUDA for the bench step comparison
#   scripts/gpu_check.sh             # RANKS=4 OUT=gpu_check TIMEOUT=1200 to change the defaults
#
# A dry run of the plumbing without a GPU: DEVICE=strict TESTS=tests/core/test_doctor.py scripts/gpu_check.sh
#
# Runs, all with TINYTRAIN_DEVICE=gpu:
#   doctor        `tinytrain doctor` on RANKS ranks (versions, CUDA-aware or not, each rank's GPU)
#   suite 1       `python -m pytest` on one rank
#   suite N       `mpirun -n RANKS python -m pytest`
#   bench step    `tinytrain bench step` (tinytrain vs PyTorch when torch is importable)
#   collectives   `mpirun -n RANKS tinytrain bench collectives --device --receive-check`: our
#                 collectives on device buffers vs MPI's own, and what the receive check costs
# and ends with one summary table (also OUT/summary.txt). Exit code: 0 if every check passed.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-gpu_check}
TIMEOUT=${TIMEOUT:-1200}
export TINYTRAIN_DEVICE=${DEVICE:-gpu}
TESTS=${TESTS:-}  # empty: the whole suite
mkdir -p "$OUT"

if ! python -c "import tinytrain.backend as b; assert b.gpu_count() > 0" 2>"$OUT/cupy.log"; then
    echo "gpu_check: no GPU for TINYTRAIN_DEVICE=$TINYTRAIN_DEVICE (see $OUT/cupy.log); pip install -e \".[gpu]\" on a machine with nvidia-smi" >&2
    exit 2
fi
GPUS=$(python -c "import tinytrain.backend as b; print(b.gpu_count())")
RANKS=${RANKS:-$((GPUS >= 2 ? (GPUS < 4 ? GPUS : 4) : 2))}  # several ranks even on one GPU (they share it)

# One check: name, then the command; its output goes to OUT/name.log, its status and seconds to OUT/status.
: >"$OUT/status"
check() {
    local name=$1
    shift
    echo "== $name: $*"
    local start=$SECONDS
    timeout "$TIMEOUT" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name $rc $((SECONDS - start))" >>"$OUT/status"
    tail -n 3 "$OUT/$name.log"
}

check doctor mpirun -n "$RANKS" tinytrain doctor --json "$OUT/doctor.json"
check suite-1 python -m pytest -q -p no:cacheprovider $TESTS
check "suite-$RANKS" mpirun -n "$RANKS" python -m pytest -q -p no:cacheprovider $TESTS
check bench-step tinytrain bench step ${STEP_ARGS:-} --json "$OUT/bench_step.json"
check collectives mpirun -n "$RANKS" tinytrain bench collectives --device --receive-check \
    --sizes ${SIZES:-4K 256K 16M} --json "$OUT/collectives.json"

python - "$OUT" "$RANKS" <<'EOF' | tee "$OUT/summary.txt"
import json, os, re, sys

out, ranks = sys.argv[1], sys.argv[2]


def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None


def last_line(name, pattern):
    path = os.path.join(out, name + ".log")
    lines = [l for l in open(path).read().splitlines() if re.search(pattern, l)] if os.path.exists(path) else []
    return lines[-1].strip() if lines else ""


doctor = load("doctor.json") or {}
step = load("bench_step.json") or []
coll = load("collectives.json") or []
facts = {
    "doctor": f"{doctor.get('cupy', '?')}; MPI CUDA-aware: {doctor.get('cuda_aware', '?')}; "
    + ", ".join(f"rank {r['rank']}->GPU {r['gpu']}" for r in doctor.get("ranks", [])),
    "suite-1": last_line("suite-1", r"passed|failed|error|skipped"),
    f"suite-{ranks}": last_line(f"suite-{ranks}", r"passed|failed|error|skipped"),
    "bench-step": "; ".join(
        f"{r['config']}: {r['tinytrain_ms']:.1f} ms" + (f", {r['ratio']:.2f}x PyTorch" if "ratio" in r else ", no torch")
        for r in step
    ),
    "collectives": "; ".join(
        f"{r['collective']} {r['size_bytes'] >> 10}K: {r['ratio']:.2f}x MPI, check {r['receive_check_pct']:+.1f}%"
        for r in coll
    ),
}
print(f"{'check':<14}{'result':<8}{'seconds':>8}  figures")
for line in open(os.path.join(out, "status")):
    name, rc, seconds = line.split()
    result = "pass" if rc == "0" else ("timeout" if rc == "124" else f"FAIL {rc}")
    print(f"{name:<14}{result:<8}{seconds:>8}  {facts.get(name, '')}")
print("ratios: bench step = tinytrain time / PyTorch time (lower is better); collectives = MPI time / ours (higher is better)")
EOF

! grep -qv " 0 " "$OUT/status"
