#!/usr/bin/env bash
# The GPU checks behind the headline numbers (docs/benchmarks.md, "Where we stand"), in parts
# that each fit one 10-minute run on one H200, ours beside the anchors in the same process:
#
#   tests  the GPU test suite (tests/gpu)                                          ~4 min
#   step   the optimizer step: 7b 8 layers Muon f = 1 vs dion.Muon (profiled), NorMuon f = 1
#          and f = 1/4 vs microsoft/dion, llama3-1B shapes f = 1/4                   ~8 min
#   ns     Newton-Schulz alone on the batches of the targets vs gram-newton-schulz, and
#          the symmetric products vs quack's (each beside its A/B switches)         ~5 min
#   host   the eager step's host time (7b, 8 layers, NorMuon f = 1/4, norm given)   ~2 min
#   train  real torchtitan training, llama3 1B: AdamW, Dion3 f = 1/4 and 1/8, two rounds in
#          alternating order (one round's tokens/s ratios move with the run order)      ~5 min
#   dist   two GPUs: the NCCL tests (tests/gpu -m multigpu), and the 7b step (8 layers,
#          NorMuon f = 1/4 and f = 1) under FSDP2 beside microsoft/dion, with its bytes  ~6 min
#
#   bash scripts/gpu_check.sh PART...      # results and logs under $OUT (default ./gpu_out)
#
# The anchors (microsoft/dion, gram-newton-schulz, quack) must be importable: the benchmarks
# name what is missing. Each command is written out as it runs, so a log shows what produced it.
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-gpu_out} PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
mkdir -p "$OUT"

run() {
    echo "+ $*"
    "$@"
}

step_rows() {  # model, layers, flavor, --only rows, JSON name, extra flags
    local model=$1 layers=$2 flavor=$3 only=$4 name=$5
    shift 5
    run "$PY" scripts/bench_step.py --model "$model" --layers "$layers" --flavor "$flavor" \
        --gram-algorithm auto --only "$only" --steps 10 --out "$OUT/$name.json" "$@"
}

for part in "$@"; do
    case "$part" in
    tests)
        run "$PY" -m pytest -q -n 8 -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
        ;;
    step)
        # with the result check read from the result beside it (the A/B of the last product's flags)
        step_rows 7b 8 muon "dion3_f1_gram+graph+norm,dion_muon+graph" step_7b_f1_muon --profile 14 \
            --settings "dion3.CHECKED_PRODUCT=False"
        step_rows 7b 8 normuon "dion3_f1_gram+graph+norm,dion_f1+graph" step_7b_f1_normuon
        step_rows 7b 8 normuon "dion3_f1/4+graph+norm,dion_f1/4+graph" step_7b_f4_normuon
        step_rows 1b_train 16 normuon "dion3_f1/4+graph+norm,dion_f1/4+graph" step_1b_train_f4_normuon
        ;;
    ns)
        run "$PY" scripts/bench_orthogonalize.py --parts ns --backends triton,cute --no-ns5 \
            --shapes 32x2048x2048,16x2752x4096 --rounds 5 --variants cute_whole_side,cute_one_batch
        run "$PY" scripts/bench_sym_ab.py --shapes 32x2048,16x2816,4x8192 --configs default --reps 5 \
            --cute-variants HALF_DIAGONAL=0
        ;;
    host)
        run "$PY" scripts/profile_host.py --model 7b --layers 8 --given-norm 2>&1 | tee "$OUT/profile_host.log"
        ;;
    train)
        run "$PY" scripts/bench_train.py --only adamw,dion3_f1/4,dion3_f1/8 --steps 40 --warmup 10 --rounds 2 --out "$OUT"
        ;;
    dist)
        run "$PY" -m pytest -q -p no:cacheprovider -m multigpu tests/gpu 2>&1 | tee "$OUT/gpu_tests_multigpu.log"
        n=0
        for only in "dion3_f1/4+graph+norm,dion_f1/4+graph" "dion3_f1_gram+graph+norm,dion_f1+graph"; do
            n=$((n + 1))
            run "$PY" -m torch.distributed.run --nproc_per_node 2 scripts/bench_step.py --model 7b --layers 8 \
                --flavor normuon --gram-algorithm auto --only "$only" --steps 10 --out "$OUT/step_7b_normuon_w2_$n.json"
        done
        ;;
    *)
        echo "gpu_check.sh: unknown part '$part'; the parts are: tests step ns host train dist" >&2
        exit 2
        ;;
    esac
done
