#!/usr/bin/env bash
# One device check on one GPU, under 12 minutes on an H100/H200, installing nothing from a registry:
# the GPU test tier, the benchmarks and the planner's calibration, each part its own process with
# its own time limit (a GPU fault poisons only its own CUDA context, a timeout loses only its part),
# every result row on disk as soon as it is measured, a short summary at the end.
#
#   bash experiments/bench/device_check.sh [RESULTS_DIR]     # default experiments/bench/results/device-<time>
#   bash experiments/bench/device_check.sh --smoke [DIR]     # CPU, tiny sizes, a minute: the test of this script
#
# Part limits (seconds; 710 in all with the set-up, and LIMIT_TP's 150 more where two GPUs are lent: with one the
# tp 2 part only writes why it measured nothing) can be changed through the environment: LIMIT_TESTS, LIMIT_CEILING,
# LIMIT_KERNELS, LIMIT_STEPS, LIMIT_FLOAT8, LIMIT_SYNCS, LIMIT_CALIBRATE, LIMIT_MOE, LIMIT_TP. A part cut short by its
# limit keeps the rows it measured. The machine's own torch and triton are used (the checkout is linked
# into a virtual environment that sees them, below); wandb and datasets are optional.
# experiments/bench/results/ is git-ignored: copy the section appended to RESULTS.md into the commit.
set -u
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:-$ROOT/experiments/bench/results/device-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SUMMARY="$OUT/summary.tsv"
: > "$SUMMARY"
PY="${PYTHON:-python3}"

# part NAME LIMIT COMMAND...: runs one part in its own process group, output in NAME.log, status in summary.tsv.
part() {
    local name="$1" limit="$2"
    shift 2
    local start=$SECONDS
    (cd "$ROOT" && timeout --kill-after=10 "$limit" "$@") > "$OUT/$name.log" 2>&1
    local status=$?
    local verdict=ok
    if [ $status -eq 124 ] || [ $status -eq 137 ]; then verdict="timeout after ${limit}s"; elif [ $status -ne 0 ]; then verdict="exit $status"; fi
    printf '%s\t%s\t%ss\n' "$name" "$verdict" "$((SECONDS - start))" | tee -a "$SUMMARY"
}

# The environment, before anything can fail.
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    uname -a
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    command -v rocm-smi > /dev/null && rocm-smi --showproductname
    "$PY" - <<'EOF'
import importlib, sys
import torch
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "hip", torch.version.hip, "gpu", gpu)
for name in ("triton", "wandb", "datasets", "transformers", "torchao"):  # wandb, datasets, torchao are optional
    try:
        print(name, importlib.import_module(name).__version__)
    except ImportError:
        print(name, "absent")
EOF
} > "$OUT/env.txt" 2>&1

# The package: the checkout mapped into a virtual environment of its own, which sees exactly the packages of
# the interpreter running this script ($PY: the machine's torch and triton, or those of the venv it is). No
# build: an editable install needs setuptools >= 68 with bdist_wheel, which an offline machine or a fresh
# Python 3.11 venv (setuptools 65 without wheel) may lack, and a venv made from a venv's python with
# --system-site-packages sees the base interpreter's packages, not the venv's. The mapping is the one
# pyproject.toml's package-dir gives (trillion.kernels is kernels/, ...), put first on the import path as
# setuptools' editable finder does, so the checkout's own trillion/ folder (the parts run in it) cannot hide it.
VENV="$OUT/venv"
link_install() {
    "$PY" -m venv --without-pip "$VENV" || return
    local site
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || return
    "$PY" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
        > "$site/machine-packages.pth" || return
    cat > "$site/trillion_checkout.py" << PYTHON || return
"""The trillion package mapped onto the checkout $ROOT (written by experiments/bench/device_check.sh)."""
import importlib.abc, importlib.util, sys
FOLDERS = {"trillion": "$ROOT/trillion", **{f"trillion.{layer}": f"$ROOT/{layer}" for layer in ("kernels", "models", "parallel", "trainer")}}


class CheckoutFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        folder = FOLDERS.get(name)
        return folder and importlib.util.spec_from_file_location(name, f"{folder}/__init__.py", submodule_search_locations=[folder])


sys.meta_path.insert(0, CheckoutFinder())
PYTHON
    echo "import trillion_checkout" > "$site/trillion_checkout.pth"
    "$VENV/bin/python" -c 'import trillion.kernels, trillion.trainer.train, torch; print("torch", torch.__file__)'
}
export -f link_install
export PY VENV ROOT
part install 120 bash -c link_install
PY="$VENV/bin/python"
export WANDB_MODE=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

if [ $SMOKE -eq 1 ]; then
    # CPU: the interpreter runs the kernels; the GPU tier must skip itself, not fail.
    export TRITON_INTERPRET=1
    part gpu_tests 300 "$PY" -m pytest -q -m gpu tests/gpu tests/float8 -p no:cacheprovider
    part bench_ceiling 120 "$PY" experiments/bench/run_all.py --smoke --only gemm,copy --out "$OUT/bench"
    # float8's code path in emulation (torchao on CPU; not a speed figure)
    part bench_float8 240 "$PY" experiments/bench/run_all.py --smoke --only float8 --out "$OUT/float8"
    part host_syncs 120 "$PY" experiments/bench/host_syncs.py --smoke --out "$OUT/syncs"
    part bench_moe 120 "$PY" experiments/bench/moe.py --smoke --out "$OUT/moe"
    # tp 2 with TP's collectives exposed, chunked and async: on a CPU the row that says why nothing is measured
    part tp_overlap 60 "$PY" experiments/bench/tp_overlap.py --device cuda --out "$OUT/tp"
else
    part gpu_tests "${LIMIT_TESTS:-200}" "$PY" -m pytest -q -m gpu tests/gpu tests/float8 -p no:cacheprovider
    part bench_ceiling "${LIMIT_CEILING:-30}" "$PY" experiments/bench/run_all.py --only gemm,copy --out "$OUT/bench"
    part bench_kernels "${LIMIT_KERNELS:-75}" "$PY" experiments/bench/run_all.py --only kernels --out "$OUT/bench"
    part bench_steps "${LIMIT_STEPS:-100}" "$PY" experiments/bench/run_all.py --only step --out "$OUT/bench"
    # a step of llama3-1b in bf16 vs float8 (tensorwise, rowwise), compiled: the float8 speed-up
    part bench_float8 "${LIMIT_FLOAT8:-120}" "$PY" experiments/bench/run_all.py --only float8 --out "$OUT/float8"
    # the trainer's step at metrics.log_freq 1 / 10 / 100 (debug model, then llama3-1b), its syncs counted per step
    part host_syncs "${LIMIT_SYNCS:-90}" "$PY" experiments/bench/host_syncs.py --device cuda --out "$OUT/syncs"
    part calibrate "${LIMIT_CALIBRATE:-30}" "$PY" -m trillion plan --calibrate --calibrate-out "$OUT/calibrated.toml"
    # bf16 grouped GEMM vs the per-expert loop, an MoE layer's dispatch share, debug-moe vs debug tokens/s
    part bench_moe "${LIMIT_MOE:-45}" "$PY" experiments/bench/moe.py --device cuda --out "$OUT/moe"
    # tp 2 on two GPUs: llama3-1b with TP's collectives exposed, with parallel.tp_overlap=4 and with async TP
    part tp_overlap "${LIMIT_TP:-150}" "$PY" experiments/bench/tp_overlap.py --device cuda --out "$OUT/tp"
fi

# The section for experiments/bench/RESULTS.md: parts and every measured table (appended there on a GPU).
{
    echo "## $(date -u +%Y-%m-%d): device check, $(grep -m1 '^python' "$OUT/env.txt")"
    echo
    echo "\`bash experiments/bench/device_check.sh\`; $(grep -m1 '^triton' "$OUT/env.txt"). Parts (limit, status, seconds):"
    echo
    echo "| part | status | seconds |"
    echo "|---|---|---|"
    sed 's/\t/ | /g; s/^/| /; s/$/ |/' "$SUMMARY"
    echo
    echo "pytest -m gpu: $(tail -n 1 "$OUT/gpu_tests.log" 2>/dev/null)"
    for table in "$OUT"/bench/*.md "$OUT"/float8/*.md "$OUT"/syncs/*.md "$OUT"/moe/*.md "$OUT"/tp/*.md; do [ -f "$table" ] && { echo; tail -n +3 "$table"; }; done
} > "$OUT/RESULTS-section.md"
[ $SMOKE -eq 0 ] && { echo; cat "$OUT/RESULTS-section.md"; } >> "$ROOT/experiments/bench/RESULTS.md"

# The short summary: parts, then the measured rows with an error, then where everything is.
echo "== device check: $OUT"
column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
grep -h '"error"' "$OUT"/bench/*.jsonl "$OUT"/float8/*.jsonl "$OUT"/syncs/*.jsonl 2>/dev/null | cut -c1-300 | head -20
tail -n 3 "$OUT/gpu_tests.log" 2>/dev/null
echo "rows: $(cat "$OUT"/bench/*.jsonl 2>/dev/null | wc -l) in $OUT/bench/*.jsonl; logs: $OUT/*.log"
! grep -qv $'\tok\t' "$SUMMARY"
