#!/usr/bin/env bash
# One prepared run of everything that needs a GPU: the `cuda` tests and the GPU benchmarks, each
# part under a time limit, results written to a folder. Made for a machine lent for a few
# minutes: the limits add up to 11 minutes, so where one command may run 10 minutes at most,
# run it twice: `gpu_check.sh tests mlp`, then `gpu_check.sh resnet loader save`.
#
#   bash benchmarks/gpu_check.sh [--dry-run] [PART ...]
#
# PART: tests, mlp, resnet, loader, save, or all (the default; in that order). Without a
# checkout installed, run it from the repository root with PYTHONPATH=$PWD. Results go to
# $OUT (the device tool's folder), else ./gpu-results: each part's standard output (the
# benchmarks' JSON) in PART.out and its errors in PART.err, the GPU and torch versions in
# gpu.txt, and summary.txt (each part's exit status and seconds; 124: its time ran out).
set -uo pipefail

PY=${PYTHON:-python3}
DEST=${OUT:-gpu-results}
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then
    DRY=1
    shift
fi
PARTS=("$@")
if [[ ${#PARTS[@]} -eq 0 || "${PARTS[0]}" == "all" ]]; then
    PARTS=(tests mlp resnet loader save)
fi

# name | seconds | command
command_of() {
    case "$1" in
        tests)  echo "240|$PY -m pytest -m cuda -o addopts= -q -p no:randomly tests" ;;
        # the captured step against the hand-written eager loop (target: 3x faster per step)
        mlp)    echo "90|$PY benchmarks/gpu_resnet.py --model mlp --optimizer adamw --precision 32 --cuda-graphs --repeats 3 --json" ;;
        # ResNet-18, bf16, batches on the GPU (target: fit at or under 1.0x the loop, 0 syncs)
        resnet) echo "110|$PY benchmarks/gpu_resnet.py --repeats 3 --json" ;;
        # a DataLoader of pinned batches: the side-stream copy of the next batch
        loader) echo "90|$PY benchmarks/gpu_resnet.py --data loader --repeats 2 --json" ;;
        # async_save's total cost per save against the staging copy (target: 2x or less)
        save)   echo "150|$PY benchmarks/checkpoint_cost.py --stall --device cuda --json" ;;
        *)      return 1 ;;
    esac
}

for part in "${PARTS[@]}"; do
    if ! command_of "$part" >/dev/null; then
        echo "gpu_check.sh: unknown part '$part' (tests, mlp, resnet, loader, save, all)" >&2
        exit 2
    fi
done

if [[ $DRY -eq 1 ]]; then
    for part in "${PARTS[@]}"; do
        line=$(command_of "$part")
        echo "$part|$line"
    done
    exit 0
fi

mkdir -p "$DEST"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$DEST/gpu.txt" 2>&1
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" >> "$DEST/gpu.txt" 2>&1
status=0
for part in "${PARTS[@]}"; do
    line=$(command_of "$part")
    limit=${line%%|*}
    cmd=${line#*|}
    start=$(date +%s)
    timeout "$limit" $cmd > "$DEST/$part.out" 2> "$DEST/$part.err"
    rc=$?
    echo "$part rc=$rc seconds=$(( $(date +%s) - start ))" | tee -a "$DEST/summary.txt"
    [[ $rc -ne 0 ]] && status=1
done
exit $status
