#!/usr/bin/env bash
# The GPU checks of this project in one call of a lent GPU machine (about 8 minutes), most valuable first. Each stage
# runs under its own time budget and writes its results into OUT as it goes, so a call cut short still returns what
# finished; `OUT/stages.jsonl` says how each stage ended.
#
#   Here, once (needs the package index):  bash bench/gpu_check.sh --fetch-wheels     # into .whl/ (git-ignored)
#   Rehearsal on this CPU machine:         bash bench/gpu_check.sh --rehearse --out /tmp/gpu_rehearsal
#   On the GPU machine (carry .whl):       bash bench/gpu_check.sh --out "$OUT"
#
# The GPU image has torch, transformers (older), peft and accelerate but no trl or datasets: the wheels in .whl/ (the
# versions of constraints.txt, for its Python 3.12) are installed into /tmp/site, and this checkout is imported from
# its working tree (PYTHONPATH), so nothing is built there.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=""
MODE=gpu
STAGES="env,cuda_tests,defaults,attention_kernels,profile,throughput,longest_grm,reward_function,long_rows,longest_disrm"
# Not in the default list (minutes of one call on its own): eight_b (on an H200), eight_b_variants (on an H200),
# eight_b_memory, mfu_variants, long_rows_capped, long_rows_beyond
SEED=""
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        --rehearse) MODE=rehearse; shift ;;
        --fetch-wheels) MODE=fetch; shift ;;
        # Some stages only (a second call after a first one cut short), e.g. --stages defaults,profile
        --stages) STAGES="$2"; shift 2 ;;
        # A report of an earlier call (gpu.json): its finished attempts are not run again.
        --seed-report) SEED="$2"; shift 2 ;;
        *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

# What the GPU image lacks (trl, datasets and the latter's dill and multiprocess), or has in a version older than the
# one CI tests (transformers 5.17 there), and liger-kernel (pure Python over the image's Triton; stage mfu_variants);
# each at constraints.txt's pin. Its huggingface_hub 1.33, tokenizers 0.23.2,
# typer and pyarrow meet these wheels' requirements, so they stay (installed with --no-deps).
CARRIED="trl transformers datasets dill multiprocess liger-kernel"

pinned() { grep -i "^$1==" constraints.txt | head -1; }

if [ "$MODE" = fetch ]; then
    mkdir -p .whl
    for name in $CARRIED; do
        spec=$(pinned "$name")
        [ -n "$spec" ] || { echo "gpu_check.sh: $name is not pinned in constraints.txt" >&2; exit 2; }
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .whl "$spec" || exit 1
    done
    ls -la .whl && du -sh .whl
    exit 0
fi

[ -n "$OUT" ] || { echo "gpu_check.sh: --out DIR is required" >&2; exit 2; }
mkdir -p "$OUT"
PY=python3
if [ "$MODE" = rehearse ]; then
    PY=${PY_REHEARSE:-.venv/bin/python}
else
    ls .whl/*.whl >/dev/null 2>&1 || { echo "gpu_check.sh: no wheels in .whl/ (run --fetch-wheels here, carry .whl)" >&2; exit 2; }
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1 \
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

[ -z "$SEED" ] || cp "$SEED" "$OUT/gpu.json"
START=$(date +%s)
# stage NAME BUDGET_SECONDS COMMAND...: run it under `timeout`, its output in OUT/NAME.log, a line in stages.jsonl;
# skipped unless NAME is in STAGES.
stage() {
    local name=$1 budget=$2; shift 2
    case ",$STAGES," in *",$name,"*) ;; *) return 0 ;; esac
    local t0=$(date +%s)
    echo "=== $name (budget ${budget}s, $(( t0 - START ))s elapsed)"
    timeout --kill-after=10 "$budget" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 )), \"timed_out\": $([ $rc -eq 124 ] && echo true || echo false)}" \
        >>"$OUT/stages.jsonl"
    tail -n 5 "$OUT/$name.log"
}

stage env 60 $PY -c "
import json, platform, torch, transformers, trl, datasets, peft, accelerate
info = {'python': platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda,
        'device': torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu',
        **{m.__name__: m.__version__ for m in (transformers, trl, datasets, peft, accelerate)}}
print(json.dumps(info)); open('$OUT/env.json', 'w').write(json.dumps(info, indent=1))
"

if [ "$MODE" = rehearse ]; then
    # Every stage's command line is exercised on CPU at a tiny size: a typo fails here, not in the GPU call.
    stage cuda_tests 120 $PY -m pytest -q --collect-only tests/test_shared_prefix.py tests/test_sequence_parallel_attention.py \
        tests/test_fused_lora.py
    stage defaults 300 $PY bench/gpu_defaults.py --use-cpu --prompt-length 1100 --out "$OUT/defaults.json"
    stage attention_kernels 60 $PY bench/gpu_attention_kernels.py --device cpu --lengths 128 --repeats 1 --out "$OUT/attention_kernels.json"
    stage profile 120 $PY bench/gpu_longest_row.py --attempt --trainers grm --impls ours --start-prompt-length 256 \
        --steps 2 --profile --num-hidden-layers 2 --out -
    stage throughput 60 $PY bench/gpu_longest_row.py --help
    stage longest_grm 60 $PY bench/gpu_longest_row.py --help
    stage reward_function 120 $PY bench/reward_function.py --prompt-tokens 1024 --repeats 1 --output "$OUT/reward_function.json"
    stage long_rows 300 $PY bench/gpu_longest_row.py --attempt --trainers grm --impls ours --start-prompt-length 256 \
        --steps 2 --long-rows --num-hidden-layers 2 --out -
    stage longest_disrm 60 $PY bench/gpu_longest_row.py --help
    stage long_rows_beyond 60 $PY bench/gpu_longest_row.py --help
    # (900 s: Qwen3-0.6B's vocabulary in bf16 is slow on a CPU without AVX-512, whose bf16 matmuls are emulated.)
    stage long_rows_capped 900 $PY bench/gpu_longest_row.py --attempt --trainers grm --impls ours \
        --start-prompt-length 256 --steps 1 --long-rows --memory-cap-gib 16 --num-hidden-layers 2 --out -
    # The 8B stage's three runs, one layer each, at short prompts (the shapes' widths and vocabularies as on the GPU).
    stage eight_b 600 bash -c "$PY bench/gpu_attention_kernels.py --device cpu --lengths 128 --repeats 1 \
        --out $OUT/attention_kernels_8b.json && R8='$PY bench/gpu_longest_row.py --rehearse --resume \
        --out $OUT/gpu_8b.json --gemm-report $OUT/attention_kernels_8b.json --impls ours --shared-k 4 --skip-k1 \
        --skip-longest --num-hidden-layers 1' && \$R8 --model llama-3.1-8b --lora-r 8 --trainers disrm \
        --throughput-prompt-lengths 256 --steps 3 --profile && \$R8 --model qwen3-8b --lora-r 16 --trainers grm \
        --throughput-prompt-lengths 256 --steps 3 --profile && \$R8 --model llama-3.1-8b --lora-r 8 --trainers disrm \
        --throughput-prompt-lengths 512 --long-rows --steps 2"
    # The variants' runs, one layer each (Liger's Triton kernels need a GPU: 'best' is rehearsed without them, its
    # other settings as on the GPU; the stage's command lines parsed).
    stage eight_b_variants 600 bash -c "V8='$PY bench/gpu_longest_row.py --rehearse --resume --out $OUT/gpu_8b_variants.json \
        --impls ours --shared-k 4 --skip-k1 --skip-longest --throughput-prompt-lengths 256 --steps 3 --profile \
        --num-hidden-layers 2' && \$V8 --model llama-3.1-8b --lora-r 8 --trainers disrm --variants default partial \
        fused_lora --unchecked-layers partial=1 && \$V8 --model qwen3-8b --lora-r 16 --trainers grm --variants \
        fused_lora && $PY bench/gpu_longest_row.py --variants default best selective_liger --unchecked-layers best=1 \
        --help >/dev/null"
    stage mfu_0_6b_levers 300 bash -c "$PY bench/gpu_longest_row.py --rehearse --resume --out $OUT/gpu_levers_0_6b.json \
        --trainers grm --impls ours --shared-k 1 --throughput-prompt-lengths 256 --skip-longest --steps 2 \
        --num-hidden-layers 2 && $PY bench/gpu_longest_row.py --variants default best_full \
        --unchecked-layers best_full=28 --help >/dev/null"
    stage eight_b_memory 300 bash -c "M8='$PY bench/gpu_longest_row.py --rehearse --resume --out $OUT/gpu_8b_memory.json \
        --trainers disrm --impls ours --shared-k 1 --skip-longest --throughput-prompt-lengths 256 --steps 2 \
        --memory-sites --num-hidden-layers 1' && \$M8 --model llama-3.1-8b --lora-r 8 && \$M8 --model llama-3.1-8b \
        && \$M8 --model qwen3-0.6b --lora-r 8"
    # (Liger's Triton kernels need a GPU: the selective variant is rehearsed, the others' options parsed.)
    stage mfu_variants 300 bash -c "$PY bench/gpu_longest_row.py --rehearse --resume --out $OUT/mfu_variants.json \
        --trainers grm --impls ours --shared-k 1 --throughput-prompt-lengths 256 --skip-longest --steps 2 \
        --variants default selective --profile-prompt-length 256 --profile-variants selective --num-hidden-layers 2 \
        && $PY bench/gpu_longest_row.py --variants default selective liger selective_liger \
        --profile-variants selective_liger --help >/dev/null"
else
    # (1) The CUDA-only tests, then each trainer with TRL's defaults on a Qwen3-shaped model (kernels recorded).
    stage cuda_tests 90 $PY -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/cuda_tests.xml" \
        tests/test_shared_prefix.py tests/test_sequence_parallel_attention.py tests/test_fused_lora.py -k cuda
    stage defaults 60 $PY bench/gpu_defaults.py --out "$OUT/defaults.json"
    # The attention kernels alone (torch's varlen_attn, SDPA's flash / cuDNN / memory-efficient) at 8K-64K: what
    # bounds the MFU below.
    stage attention_kernels 60 $PY bench/gpu_attention_kernels.py --out "$OUT/attention_kernels.json"
    # (2) Ours vs stock TRL on one GPU (Qwen3-0.6B shape). Each call of gpu_longest_row.py adds to OUT/gpu.json
    # (--resume): where one 32K step of ours spends its time (the MFU's bound), tokens/s and peak memory at 8K and
    # 32K, then the longest rows. Every attempt is a fresh process of ~20 s (model init on the GPU) plus its steps.
    LONGEST="$PY bench/gpu_longest_row.py --resume --out $OUT/gpu.json --timeout 150"
    stage profile 60 $LONGEST --throughput-prompt-lengths --skip-longest --profile-prompt-length 32768
    stage throughput 150 $LONGEST --throughput-prompt-lengths 8192 32768 --skip-longest
    # Stock GRM stops at the full-vocabulary logits (between 8K and 32K); ours is tried from 32K up to a cap that
    # fits the call (its ratio is then a lower bound, said so in summary.json).
    stage longest_grm 150 bash -c "$LONGEST --throughput-prompt-lengths --trainers grm --impls stock \
        && $LONGEST --throughput-prompt-lengths --trainers grm --impls ours --start-prompt-length 32768 \
        --max-prompt-length 65536"
    # (4) LongRMReward vs TRL's reward-model path: 8 completions of a 16K prompt on the GPU.
    stage reward_function 90 $PY bench/reward_function.py --device cuda --output "$OUT/reward_function.json"
    # (Issue 41) The long-row settings (checkpoint offload + tiled MLP) on ours at a 65K prompt, next to without: the
    # memory they save and what a step pays for it; their plans are in bench/gpu_plan_vs_measured.py.
    stage long_rows 120 $LONGEST --throughput-prompt-lengths --skip-longest --long-rows-prompt-lengths 65536
    # DisRM rows reach hundreds of thousands of tokens on 80 GB (a 256K step of this model is minutes): stock is
    # searched from 32K (its padded pair's attention mask grows with the square of the length), then ours is tried
    # once at twice stock's longest prompt (the target; the ratio is then a lower bound). Last: the longest stage.
    stage longest_disrm 420 $LONGEST --throughput-prompt-lengths --trainers disrm --start-prompt-length 32768 \
        --ours-at-stock-multiple 2 --timeout 240
    # (Issue 41) One prompt length past what the plan says fits without the long-row settings and well within what it
    # says fits with them (Qwen3-0.6B shape on 80 GB, k = 1, cuDNN's attention: at 557,056 it plans 85.4 GiB without,
    # 41.5 with; bench/results/gpu/plan_longest_long_rows_cudnn.json). Without ran out of memory on c20372c
    # (bench/results/gpu/long_rows_557k.json: pass it as --seed-report and only with runs); one step with them is
    # ~8 minutes (38 s at 163,840 tokens, attention growing with the square of the length): a call of its own.
    stage long_rows_beyond 590 $LONGEST --throughput-prompt-lengths --skip-longest --long-rows-prompt-lengths 557056 \
        --steps 1 --timeout 560
    # (Issue 41) The same question where a step is seconds, not minutes: the GPU's caching allocator capped at 16 GiB
    # (a 16 GB GPU emulated). The plan (bench/results/gpu/plan_longest_long_rows_16gib.json, cuDNN's attention) fits
    # prompts up to 81,920 without the long-row settings and 172,032 with them; each run below is on one side of a
    # boundary, the most telling first: 98,304 without (plan: out of memory) and with (fits), then with at 163,840
    # (fits) and 212,992 (out of memory), then without at 73,728 (fits). Each attempt is a fresh process (~20 s) and
    # two steps (the optimizer's states exist from the second on: the steady step the plan is of; one-step runs of
    # c20372c/bb3ed38 are in bench/results/gpu/long_rows_16gib.json).
    CAPPED="$PY bench/gpu_longest_row.py --resume --out $OUT/long_rows_16gib.json --timeout 150 --memory-cap-gib 16 \
        --throughput-prompt-lengths --skip-longest --steps 2"
    stage long_rows_capped 450 bash -c "$CAPPED --long-rows-settings without --long-rows-prompt-lengths 98304; \
        $CAPPED --long-rows-settings with --long-rows-prompt-lengths 98304 163840 212992; \
        $CAPPED --long-rows-settings without --long-rows-prompt-lengths 73728"
    # (Issue 55) The paper's 8B shapes on one H200 (random weights built on the GPU from the bundled shapes, LoRA on
    # all linear layers as the *_lora.yaml recipes, TRL's defaults, k = 4 rejected responses on a shared prefix):
    # the card's GEMM rate first (the measured peak of a second MFU), then Llama-3.1-8B as a DisRM and Qwen3-8B as a
    # GRM at a 32K prompt (4 steps: the 2nd and 3rd timed, the 4th profiled), then the DisRM at 131K with the
    # long-row settings (2 steps). Their plans: bench/gpu_plan_vs_measured.py --report OUT/gpu_8b.json, on CPU.
    R8="$PY bench/gpu_longest_row.py --resume --out $OUT/gpu_8b.json --gemm-report $OUT/attention_kernels_8b.json \
        --impls ours --shared-k 4 --skip-k1 --skip-longest"
    stage eight_b 420 bash -c "$PY bench/gpu_attention_kernels.py --lengths 32768 --repeats 5 \
        --out $OUT/attention_kernels_8b.json; \
        $R8 --model llama-3.1-8b --lora-r 8 --trainers disrm --throughput-prompt-lengths 32768 --steps 4 --profile \
        --timeout 150; \
        $R8 --model qwen3-8b --lora-r 16 --trainers grm --throughput-prompt-lengths 32768 --steps 4 --profile \
        --timeout 150; \
        $R8 --model llama-3.1-8b --lora-r 8 --trainers disrm --throughput-prompt-lengths 131072 --long-rows --steps 2 \
        --timeout 240"
    # (Issue 64) The 8B shapes at 32K, k = 4, LoRA, TRL's defaults, with each lever and with all of them ('best':
    # selective checkpointing, Liger's kernels, the first N layers unchecked, fused LoRA), each run profiled (its 4th
    # step): the target runs first (DisRM default and best, GRM best), then each lever alone, then the GRM default.
    # N is the memory plan's proposal for the run on an H200 (3% margin, planned without Liger's kernels, which keep
    # less; bench/results/gpu/h200/plan_unchecked_8b.json, `gpu_plan_vs_measured.py --propose-unchecked`); a run that
    # runs out of memory with it is run again with 3 layers fewer unchecked.
    V8="$PY bench/gpu_longest_row.py --resume --out $OUT/gpu_8b_variants.json --impls ours --shared-k 4 --skip-k1 \
        --skip-longest --throughput-prompt-lengths 32768 --steps 4 --profile --timeout 120 --unchecked-fallback 3"
    LLAMA="--model llama-3.1-8b --lora-r 8 --trainers disrm"
    QWEN="--model qwen3-8b --lora-r 16 --trainers grm"
    stage eight_b_variants 450 bash -c "$V8 $LLAMA --variants default best --unchecked-layers best=15; \
        $V8 $QWEN --variants best --unchecked-layers best=14; \
        $V8 $LLAMA --variants selective_liger partial fused_lora --unchecked-layers partial=16; \
        $V8 $QWEN --variants default"
    # (Issue 64) The 0.6B shape's MFU at 32K (GRM, k = 1, full parameters) by default and with the levers that apply
    # without LoRA (selective checkpointing, Liger's kernels, every layer unchecked: the plan's proposal on an H200,
    # 74.6 GiB planned without Liger's kernels), side by side, each profiled.
    stage mfu_0_6b_levers 200 $PY bench/gpu_longest_row.py --resume --out "$OUT/gpu_levers_0_6b.json" --trainers grm \
        --impls ours --shared-k 1 --throughput-prompt-lengths 32768 --skip-longest --steps 4 --profile --timeout 100 \
        --variants default best_full --unchecked-layers best_full=28
    # (Issue 55) Which code allocated the tensors live at a run's peak (`cuda_memory_sites.py`, from the CUDA
    # allocator's history): Llama-3.1-8B's width with 4 layers at a 32K prompt, through LoRA and with full parameters,
    # and Qwen3-0.6B through LoRA. Prepared to find the 8B LoRA plan gap, since found on CPU (docs/gpu.md: a PEFT config
    # shared by two traces, cuDNN's backward workspace); kept for the next gap.
    M8="$PY bench/gpu_longest_row.py --resume --out $OUT/gpu_8b_memory.json --trainers disrm --impls ours \
        --shared-k 1 --skip-longest --throughput-prompt-lengths 32768 --steps 2 --memory-sites --timeout 120"
    stage eight_b_memory 300 bash -c "$M8 --model llama-3.1-8b --num-hidden-layers 4 --lora-r 8; \
        $M8 --model llama-3.1-8b --num-hidden-layers 4; $M8 --model qwen3-0.6b --lora-r 8"
    # (Issue 42) What bounds the MFU at 32K (docs/gpu.md: the attention's recompute under gradient checkpointing,
    # elementwise kernels): ours GRM at a 32K prompt by default, with selective checkpointing, with Liger's kernels
    # and with both, side by side in one call (4 steps, the first not timed), then a profile of both together.
    stage mfu_variants 300 $PY bench/gpu_longest_row.py --resume --out "$OUT/mfu_variants.json" --timeout 120 \
        --trainers grm --impls ours --shared-k 1 --throughput-prompt-lengths 32768 --skip-longest --steps 4 \
        --variants default selective liger selective_liger --profile-prompt-length 32768 \
        --profile-variants selective_liger
fi
echo "=== done in $(( $(date +%s) - START ))s; stages:"
cat "$OUT/stages.jsonl"
