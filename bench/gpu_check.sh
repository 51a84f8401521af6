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
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        --rehearse) MODE=rehearse; shift ;;
        --fetch-wheels) MODE=fetch; shift ;;
        *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

# What the GPU image lacks (trl, datasets and the latter's dill and multiprocess), or has in a version older than the
# one CI tests (transformers 5.17 there); each at constraints.txt's pin. Its huggingface_hub 1.33, tokenizers 0.23.2,
# typer and pyarrow meet these wheels' requirements, so they stay (installed with --no-deps).
CARRIED="trl transformers datasets dill multiprocess"

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

START=$(date +%s)
# stage NAME BUDGET_SECONDS COMMAND...: run it under `timeout`, its output in OUT/NAME.log, a line in stages.jsonl.
stage() {
    local name=$1 budget=$2; shift 2
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
    stage cuda_tests 120 $PY -m pytest -q --collect-only tests/test_shared_prefix.py tests/test_sequence_parallel_attention.py
    stage defaults 300 $PY bench/gpu_defaults.py --use-cpu --prompt-length 128 --out "$OUT/defaults.json"
    stage longest_row 60 $PY bench/gpu_longest_row.py --help
    stage reward_function 60 $PY bench/reward_function.py --help
else
    # (1) The CUDA-only tests, then each trainer with TRL's defaults on a Qwen3-shaped model (kernels recorded).
    stage cuda_tests 90 $PY -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/cuda_tests.xml" \
        tests/test_shared_prefix.py tests/test_sequence_parallel_attention.py -k cuda
    stage defaults 90 $PY bench/gpu_defaults.py --out "$OUT/defaults.json"
    # (2) Ours vs stock TRL on one GPU (Qwen3-0.6B shape): tokens/s and peak memory, MFU, then the longest rows.
    stage longest_row 210 $PY bench/gpu_longest_row.py --throughput-prompt-lengths 8192 32768 --timeout 120 \
        --out "$OUT/gpu.json"
    # (4) LongRMReward vs TRL's reward-model path: 8 completions of a 16K prompt.
    stage reward_function 60 $PY bench/reward_function.py --output "$OUT/reward_function.json"
fi
echo "=== done in $(( $(date +%s) - START ))s; stages:"
cat "$OUT/stages.jsonl"
