#!/usr/bin/env bash
# The GPU checks of ../shared/GPU.md in one command, for a lent device machine's short lease: what only a GPU can
# show first (the CUDA tests of what the open issues changed, verify on CUDA; where a simulated TP 8 rank's time
# goes, Llama-3 8B and 70B layers, plain and sequence-parallel, every schedule, with a profile split per mode and
# the same 8B runs on the code before when a copy of it is at build/baseline; the decode step's checks; TP 1
# against torch.nn in bf16), then the whole suite with the time left (`BUDGET` seconds in all).
#
#   OUT=/some/dir BUDGET=480 bash benchmarks/gpu_checks.sh      # the checks before the suite: about 5 minutes
#
# The code before, for the paired runs: `mkdir -p build/baseline && git archive REV tplayers | tar -x -C
# build/baseline` (REV: 2311189 for issue 52's changes), then give the device tool carry=["build/baseline"].
#
# Logs land in $OUT: checks.log (environment, tests, verify, benchmarks), sim_8b*.json (bench --save),
# prof_8b*.json (benchmarks/gpu_profile.py), suite.log and junit.xml (the suite; a suite stopped by the budget is
# interrupted with SIGINT, so pytest still prints what failed so far).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to a folder for the logs}
BUDGET=${BUDGET:-480}
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
    nproc
    $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', \
torch.cuda.nccl.version(), 'transformers', transformers.__version__)"
} >"$log" 2>&1

# 1. what the open issues changed, on CUDA: no host sync from the collective checks (issue 52); the linears on CUDA
step 120 "CUDA tests of issue 52" $PY -m pytest -q -p no:cacheprovider tests/test_gpu_syncs.py tests/test_step_counts.py \
    tests/test_linear.py -k "gpu or cuda or counts or sync or reorders"
# every TP module against dense on CUDA: NCCL world of one (float32, bfloat16), gloo ranks sharing the GPU
step 90 "verify f32 TP 1 NCCL" $PY -m tplayers verify --device cuda --tp 1 --dtype float32 --no-progress
step 90 "verify bf16 TP 1 NCCL" $PY -m tplayers verify --device cuda --tp 1 --dtype bfloat16 --no-progress
step 120 "verify f32 TP 2,4 gloo on CUDA" $PY -m tplayers verify --device cuda --backend gloo --tp 2,4 \
    --dtype float32 --no-progress
# 2. where the GPU's time goes (issue 52's table): the simulated TP 8 layer, every schedule; the code before
SIM=(-m tplayers bench --simulate --device cuda --dtype bfloat16 --iters 20 --warmup 3 --tp 8 --batch 4 --seq 2048
     --chunks 2 --link h100-nvlink --no-progress)
for sp in "" "--sequence-parallel"; do
    step 150 "8B${sp:+ SP}" $PY "${SIM[@]}" --shape llama3-8b $sp --save "$OUT/sim_8b${sp:+_sp}.json"
    if [ -d build/baseline/tplayers ]; then
        step 150 "8B${sp:+ SP} BEFORE (build/baseline)" env PYTHONPATH="$PWD/build/baseline" $PY "${SIM[@]}" \
            --shape llama3-8b $sp
    fi
    step 150 "profile 8B${sp:+ SP}" $PY benchmarks/gpu_profile.py --shape llama3-8b --tp 8 --batch 4 --seq 2048 \
        $sp --json "$OUT/prof_8b${sp:+_sp}.json"
    step 150 "70B${sp:+ SP}" $PY "${SIM[@]}" --shape llama3-70b $sp
done
# 3. the drift digests and fingerprints on CUDA tensors: a decode step (one token, Llama-3-8B MLP widths), the block
step 90 "drift digest cost, decode, bf16" $PY benchmarks/drift_digest_cost.py --module decode --device cuda \
    --dtype bfloat16 --repeats 40
step 90 "drift digest cost, large block, bf16" $PY benchmarks/drift_digest_cost.py --module large --device cuda \
    --dtype bfloat16 --repeats 30
# 4. the library adds no cost: TP 1 fused column/row against torch.nn, bf16, a Llama-3-8B MLP
step 90 "TP 1 vs torch.nn, llama3-8b MLP, bf16" $PY -m tplayers bench --device cuda --tp 1 --dtype bfloat16 \
    --shape llama3-8b --batch 4 --seq 2048 --modes tp,dense --iters 20 --warmup 3 --no-progress

# 5. the suite, CUDA tests included, with the time left
left=$((BUDGET - SECONDS))
echo "=== [$SECONDS s] suite with ${left} s" >>"$log"
timeout -s INT -k 20 "$left" $PY -m pytest -q -rfE -n 8 --dist loadfile -p no:cacheprovider --timeout 240 \
    --junitxml="$OUT/junit.xml" >"$OUT/suite.log" 2>&1
echo "=== suite rc $? after $SECONDS s" >>"$log"
tail -40 "$OUT/suite.log"
cat "$log"
