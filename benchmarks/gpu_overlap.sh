#!/usr/bin/env bash
# Issue 52's GPU checks in one command, for a lent device machine's short lease (../shared/GPU.md): the CUDA tests of
# what this issue changed, then where a simulated TP 8 rank's time goes (Llama-3 8B and 70B layers, plain and
# sequence-parallel, every schedule; the same 8B runs on the code before this issue's changes when a copy of it is
# at build/baseline), a profiler breakdown per mode, the decode step with checks on and off, TP 1 against torch.nn.
#
#   OUT=/some/dir bash benchmarks/gpu_overlap.sh            # about 5 minutes on an H200
#
# Logs land in $OUT: checks.log (everything printed, each step's status), sim_*.json (bench --save), prof_*.json.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to a folder for the logs}
PY=${PY:-python3}
log="$OUT/checks.log"

step() {  # step SECONDS DESCRIPTION COMMAND...: run one check under its own limit, logged with its status
    local limit=$1 what=$2; shift 2
    echo "=== [$SECONDS s] $what: $*" >>"$log"
    timeout -k 5 "$limit" "$@" >>"$log" 2>&1
    echo "=== rc $? after $SECONDS s" >>"$log"
}

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
} >"$log" 2>&1

# 1. the CUDA tests of this change: no host sync from the collective checks; the counts; the linears on CUDA
step 120 "CUDA tests" $PY -m pytest -q -p no:cacheprovider tests/test_gpu_syncs.py tests/test_step_counts.py \
    tests/test_linear.py -k "gpu or cuda or counts or sync or reorders"

# 2. the simulated TP 8 layer, every schedule (the issue's table), this code and (8B) the code before it
SIM=(-m tplayers bench --simulate --device cuda --dtype bfloat16 --iters 20 --warmup 3 --tp 8 --batch 4 --seq 2048
     --chunks 2 --link h100-nvlink --no-progress)
for sp in "" "--sequence-parallel"; do
    tag=${sp:+_sp}
    step 150 "8B$tag" $PY "${SIM[@]}" --shape llama3-8b $sp --save "$OUT/sim_8b$tag.json"
    if [ -d build/baseline/tplayers ]; then
        step 150 "8B$tag BEFORE (build/baseline)" env PYTHONPATH="$PWD/build/baseline" $PY "${SIM[@]}" \
            --shape llama3-8b $sp
    fi
done
for sp in "" "--sequence-parallel"; do
    step 150 "70B${sp:+ SP}" $PY "${SIM[@]}" --shape llama3-70b $sp --save "$OUT/sim_70b${sp:+_sp}.json"
done

# 3. where the GPU's time goes, per mode (GEMM, attention, copies, other, the emulated link, compute-stream idle)
for sp in "" "--sequence-parallel"; do
    step 150 "profile 8B${sp:+ SP}" $PY benchmarks/gpu_profile.py --shape llama3-8b --tp 8 --batch 4 --seq 2048 $sp \
        --json "$OUT/prof_8b${sp:+_sp}.json"
done

# 4. the decode step (one token, Llama-3-8B MLP widths) with the collective checks on and off; TP 1 vs torch.nn
step 90 "drift digest / checks cost, decode, bf16" $PY benchmarks/drift_digest_cost.py --module decode --device cuda \
    --dtype bfloat16 --repeats 40
step 90 "TP 1 vs torch.nn, llama3-8b MLP, bf16" $PY -m tplayers bench --device cuda --tp 1 --dtype bfloat16 \
    --shape llama3-8b --batch 4 --seq 2048 --modes tp,dense --iters 20 --warmup 3 --no-progress
cat "$log"
