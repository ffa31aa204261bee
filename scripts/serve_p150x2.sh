#!/usr/bin/env bash
# Serve a Qwen3.6 checkpoint with vLLM + the vllm-tt plugin on two Blackhole P150a cards (TP=2), OpenAI API on
# port 8000 of every interface: `qwen36 serve --device p150x2` with the cards' defaults. docs/serving.md explains
# every option.
#
#   scripts/serve_p150x2.sh /path/to/checkpoint [K]     # K > 0: MTP speculative decoding with K drafts
#                                                        # K = auto: depth per step (the fitted controller), at most 7
#   MAX_MODEL_LEN=32768 PORT=8000 (defaults)
set -euo pipefail
CKPT=${1:?usage: serve_p150x2.sh CHECKPOINT_DIR [K]}
K=${2:-0}
spec=()
if [ "$K" != 0 ]; then
  spec=(--spec-k "$K")
fi
exec qwen36 serve --device p150x2 --checkpoint "$CKPT" --max-num-seqs 1 --max-model-len "${MAX_MODEL_LEN:-32768}" \
  --precision performance --host 0.0.0.0 --port "${PORT:-8000}" "${spec[@]}"
