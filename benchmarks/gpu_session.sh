#!/usr/bin/env bash
# One GPU session's measurements as one command, sized for a device call of at most 10 minutes (a task is lent
# 15 minutes of device time in all, start-up included): where the trainer stands against transformers and where
# its step goes, then how MFU grows with the batch. Every run's output and JSON land in $OUT (default runs/gpu).
#
#   bash benchmarks/gpu_session.sh                      # on the GPU machine, from the repository root
#   bash benchmarks/gpu_session.sh --dry-run-cpu ...    # the same three runs on a tiny CPU model: checks the script
#
# On an H200 (the plan below for >= 100 GiB), issue 14's open question, 55% MFU, alone (the ratios to HF were
# measured at bf8948e, 2026-11-27, with four rows at batch 8 and the compiled pairs at 16 and 32): ours compiled at
# batch 32 with --profile 2; the floor under that step's matmuls (benchmarks/gemm_floor.py: each matmul alone, under
# cuBLAS and cuBLASLt, and with q, k and v fused); batch 32 again with torch's matmuls on cuBLASLt (b32lt); batch 48
# (b48, ~112 GiB), where the fixed optimizer step weighs least (batch 56 fits too, at a lower MFU: 2026-11-28).
# ~5 minutes on an H200.
# On an H100 (80 GB) four rows do not fit at batch 8, so pairs, the open question first: ours compiled alone at batch
# 24 (b24: the largest batch that fits, where MFU is highest; the issue's goal is read there: batch 28 fits too,
# at a lower MFU), benchmarks/kernel_forms.py (forms.txt: RoPE, the norm backward, attention's backends and fused
# projections in other forms), batch 24 once more (b24b) with Python's automatic garbage collection, then the
# figures already measured: the compiled pair at batch 8 with the profile (b8c), the compiled pair of a wider model
# (w8), the eager pair at 8 (b8e). b8c and b24 are
# profiled so that the last step can fit the planner's GPU kernel costs on two batches and check its predictions,
# the wider model's included (fit.txt; docs/planner.md). Each step runs only if its timeout still fits the call's
# SESSION_S seconds (default 570, under the device tool's 10 minutes), so a slow start drops the last, not the first.
# Extra arguments go to every run (after the run's own, so they win). $PYTHON (default python) runs them.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
PYTHON=${PYTHON:-python}
case ${GPU_MEM_GIB:-} in
    *[!0-9]*)
        echo "gpu_session.sh: GPU_MEM_GIB=$GPU_MEM_GIB is not a whole number of GiB; set it like GPU_MEM_GIB=80, or unset it to read the card" >&2
        exit 2 ;;
esac
SESSION_S=${SESSION_S:-570}
case $SESSION_S in ''|*[!0-9]*)
    echo "gpu_session.sh: SESSION_S=$SESSION_S is not a whole number of seconds; set it like SESSION_S=570" >&2
    exit 2 ;;
esac
if ! mkdir -p "$OUT" 2>/dev/null || [ ! -w "$OUT" ]; then
    echo "gpu_session.sh: OUT=$OUT cannot be created or written; set OUT to a writable folder" >&2
    exit 2
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
{
    git describe --always --dirty 2>/dev/null || echo "commit unknown"  # -dirty: the tree is not HEAD's
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv 2>/dev/null
    "$PYTHON" -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
} > "$OUT/env.txt" 2>&1
status=0
fits() {  # name, seconds: whether a step that may take that long still fits the call
    if [ $((SECONDS + $2)) -gt "$SESSION_S" ]; then
        echo "[gpu_session] $1 skipped: $SECONDS s gone, its $2 s could overrun the call's $SESSION_S" >&2
        return 1
    fi
}
run() {  # name, seconds, gpu_single.py arguments...
    local name=$1 limit=$2
    shift 2
    fits "$name" "$limit" || return 0
    echo "[gpu_session $(date +%H:%M:%S)] $name: $PYTHON benchmarks/gpu_single.py $*" >&2
    timeout "$limit" "$PYTHON" benchmarks/gpu_single.py "$@" --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
    local rc=$?
    [ "$rc" -eq 0 ] || { echo "[gpu_session] $name exited $rc: see $OUT/$name.txt" >&2; status=1; }
}
forms() {  # the kernels below the copy rate against other forms of the same computation (RoPE, the norm
    # backward, attention's backends: benchmarks/kernel_forms.py, ~2 minutes), when the call has them; of the extra
    # arguments only --dry-run-cpu applies to it
    fits forms 150 || return 0
    local dry=()
    case " $* " in *" --dry-run-cpu "*) dry=(--dry-run-cpu --rounds 1 --iters 1) ;; esac
    echo "[gpu_session $(date +%H:%M:%S)] forms: $PYTHON benchmarks/kernel_forms.py ${dry[*]}" >&2
    timeout 150 "$PYTHON" benchmarks/kernel_forms.py "${dry[@]}" > "$OUT/forms.txt" 2>&1 \
        || { echo "[gpu_session] forms exited non-zero: see $OUT/forms.txt" >&2; status=1; }
}
floor() {  # every matmul of b32's step alone (benchmarks/gemm_floor.py, ~1 minute): the floor under its matmul
    # time, and b32's step at that floor; of the extra arguments only --dry-run-cpu applies to it
    fits floor 120 || return 0
    local dry=()
    case " $* " in *" --dry-run-cpu "*) dry=(--dry-run-cpu --rounds 1 --iters 1 --step-row "ours eager") ;; esac
    echo "[gpu_session $(date +%H:%M:%S)] floor: $PYTHON benchmarks/gemm_floor.py --batch 32 ${dry[*]}" >&2
    timeout 120 "$PYTHON" benchmarks/gemm_floor.py --batch 32 --step-json "$OUT/b32.json" "${dry[@]}" \
        > "$OUT/floor.txt" 2>&1 || { echo "[gpu_session] floor exited non-zero: see $OUT/floor.txt" >&2; status=1; }
}
# The plan follows the card's memory (nvidia-smi; GPU_MEM_GIB overrides it; none read, as on the CPU dry run, takes
# the large plan). Every row stays resident so rounds can alternate, ~13 GiB each (fp32 weights, gradients, AdamW).
mem=${GPU_MEM_GIB:-$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)}
mem=${mem%%.*}
case $mem in *[!0-9]*) mem=0 ;; esac  # nothing a number read: the large plan, as with no GPU
[ -n "${GPU_MEM_GIB:-}" ] || mem=$(( ${mem:-0} / 1024 ))
echo "[gpu_session] $mem GiB of GPU memory read" >&2
# A wider model (d_model 4096, 8 blocks, head_dim 128: 1.7B parameters, as many activations per token as the ~1B;
# the planner predicts 58% MFU at batch 8 on an H100, which measured 54.5% at b13d967) checks the planner on a shape
# it was not fitted on; the dry run's is tiny.
case " $* " in
    *" --dry-run-cpu "*) wide=(--d-model 128 --layers 1 --heads 4 --kv-heads 2) ;;
    *) wide=(--d-model 4096 --layers 8 --heads 32 --kv-heads 8) ;;
esac
if [ "$mem" -eq 0 ] || [ "$mem" -ge 100 ]; then  # an H200 (141 GiB)
    # The open question, issue 14's 55% MFU, read where MFU is highest: ours compiled alone, the others measured at
    # bf8948e (docs/benchmarks.md). First batch 32 with the profile; then the floor under its matmul time, every
    # matmul of that step timed alone (benchmarks/gemm_floor.py, under cuBLAS and cuBLASLt, and with q, k and v
    # fused), and what MFU the step would have at that floor; then batch 32 with torch's matmuls on cuBLASLt
    # (b32lt); then the largest batch that fits (b48: ~2.1 GiB a sequence, ~112 GiB), where the fixed optimizer
    # step weighs least.
    run b32 150 --batch 32 --profile 2 --rows "ours compiled" "$@"
    floor "$@"
    run b32lt 150 --batch 32 --profile 2 --rows "ours compiled" --blas cublaslt "$@"
    PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
        run b48 170 --batch 48 --profile 2 --rows "ours compiled" "$@"
    fitted="b32 b48"
else  # an H100 (80 GB): ours eager at batch 8 (~47 GiB) and three other rows' ~39 do not fit, so pairs; first
    # ours compiled alone at the largest batch it fits (24: 61.6 GiB at b13d967), where the goal's MFU is read, then
    # the rest (the order at the top). Expandable segments: batch 24 runs near the card's limit, where fragmentation
    # decides.
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
    run b24 130 --batch 24 --profile 2 --rows "ours compiled" "$@"
    # (Two kernel experiments ran in this slot on 2026-11-27, at 8eb85bc: RoPE's swap form with the norm's reductions
    # apart, 0.9% slower, and programmatic dependent launch, no faster; docs/benchmarks.md. gpu_single.py keeps
    # --rope and --sdpa, and Inductor reads TORCHINDUCTOR_* settings from the environment, for the next such test.)
    forms "$@"
    # Batch 24 again with Python's automatic garbage collection, as the three runs at b13d967 had it (--gc-every 0;
    # b24 collects as the trainer now does, train.gc_every=50): its report says what the collector took inside the
    # timed steps. (Inductor's kernel tuning, probed at b13d967, changed nothing worth keeping: docs/benchmarks.md.)
    run b24b 110 --batch 24 --profile 2 --rows "ours compiled" --gc-every 0 "$@"
    run b8c 150 --batch 8 --profile 2 --rows "ours compiled,HF compiled" "$@"
    run w8 150 "${wide[@]}" --batch 8 --profile 2 --rows "ours compiled,HF compiled" "$@"
    run b8e 100 --batch 8 --rows "ours eager,HF eager" "$@"
    fitted="b8c b24 w8"
fi
# The planner's GPU kernel costs (plan/hardware.GPU_KERNELS) fitted on this card's two profiled batches, and its
# one-device step against every compiled run's. The CPU dry run compiles nothing, so it has nothing to fit.
case " $* " in
    *" --dry-run-cpu "*) ;;
    *)
        # only this call's runs: a folder kept from an earlier session (a machine's /tmp) may hold older ones
        files=$(for n in $fitted; do [ "$OUT/$n.json" -nt "$OUT/env.txt" ] && echo "$OUT/$n.json"; done)
        if [ "$(echo "$files" | grep -c .)" -lt 2 ]; then  # the call dropped the second batch: nothing to fit
            echo "[gpu_session] the kernel fit skipped: it needs two of $fitted, and the call ran $(echo $files)" >&2
        else
            # shellcheck disable=SC2086  # one argument per file
            "$PYTHON" benchmarks/gpu_kernels_fit.py $files > "$OUT/fit.txt" 2>&1 \
                || { echo "[gpu_session] the kernel fit failed: see $OUT/fit.txt" >&2; status=1; }
        fi ;;
esac
exit $status
