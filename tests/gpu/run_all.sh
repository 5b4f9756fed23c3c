#!/usr/bin/env bash
# Every GPU check of tests/gpu, each under its own timeout, then one table:
#   check | result (pass/fail/skip) | seconds | detail
# Under 8 minutes on one machine with one or more GPUs (the timeouts add up to 475 s). On a
# machine without CUDA every row is "skip: no CUDA" and the exit code is 0; otherwise the
# exit code is 1 when a check failed. A check exits 77 (and prints "SKIP: why") to be skipped.
#
#   bash tests/gpu/run_all.sh            # PYTHON=... to choose the interpreter
set -u
cd "$(dirname "$0")/../.." || exit 2
PY=${PYTHON:-python}
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/frtools-gpu-checks.XXXXXX")

probe=$("$PY" - <<'EOF' 2>/dev/null
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(n, torch.__version__.split("+")[0])
EOF
) || probe="0 none"
read -r GPUS TORCH <<<"$probe"
PAIR=$(( GPUS >= 2 ? 2 : 1 ))
[ "$GPUS" -ge 2 ] && SAME="" || SAME="--same-gpu"
new_torch=$("$PY" -c "import sys; v=tuple(map(int,'$TORCH'.split('.')[:2])); print(int(v >= (2, 15)))" 2>/dev/null || echo 0)

# name | timeout s | needs torch >= 2.15 | command
CHECKS=(
    "cuda_events|45|0|$PY tests/gpu/check_blackbox_cuda.py"
    "recorder_nccl|100|0|$PY tests/gpu/check_recorder_gpu.py --ranks $PAIR"
    "fr_nccl2|100|1|$PY tests/gpu/check_fr_nccl2.py --ranks $PAIR"
    "windows_nccl2|120|1|$PY tests/gpu/check_windows_nccl2.py $SAME"
    "shrink_group|85|1|$PY tests/gpu/check_shrink_group.py --ranks $PAIR"
    "device_facts|25|0|$PY tests/gpu/check_device_facts.py"
)

rows=()
failed=0
for spec in "${CHECKS[@]}"; do
    IFS='|' read -r name limit needs cmd <<<"$spec"
    if [ "$GPUS" -eq 0 ]; then
        rows+=("$name|skip|0|no CUDA (torch $TORCH)")
        continue
    fi
    if [ "$needs" = 1 ] && [ "$new_torch" != 1 ]; then
        rows+=("$name|skip|0|needs torch >= 2.15, this is $TORCH")
        continue
    fi
    log="$LOGS/$name.log"
    start=$(date +%s)
    timeout --kill-after=10 "$limit" $cmd >"$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    case $rc in
    0) result=pass; detail=$(grep -v -E '^(PASS|FAIL)$' "$log" | grep -v '^\s*$' | tail -n 1) ;;
    77) result=skip; detail=$(grep -m1 '^SKIP:' "$log" | sed 's/^SKIP: *//') ;;
    124|137) result=fail; detail="timed out after ${limit} s"; failed=1 ;;
    *) result=fail; detail=$(grep -m1 -E '^\s+|FAILED|Error' "$log" | sed 's/^\s*//'); failed=1 ;;
    esac
    rows+=("$name|$result|$secs|${detail:0:70}")
done

printf '%-15s %-6s %7s  %s\n' check result seconds detail
printf '%-15s %-6s %7s  %s\n' ------------- ------ ------- ------
for row in "${rows[@]}"; do
    IFS='|' read -r name result secs detail <<<"$row"
    printf '%-15s %-6s %7s  %s\n' "$name" "$result" "$secs" "$detail"
done
echo "GPUs: $GPUS, torch $TORCH; logs: $LOGS"
exit $failed
