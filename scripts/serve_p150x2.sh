#!/usr/bin/env bash
# Serve a Qwen3.6 checkpoint with vLLM + the vllm-tt plugin on two Blackhole P150a cards (TP=2), OpenAI API on
# port 8000. docs/serving.md explains every option.
#
#   scripts/serve_p150x2.sh /path/to/checkpoint [K]     # K > 0: MTP speculative decoding with K drafts
#                                                        # K = auto: depth per step (the fitted controller), at most 7
set -euo pipefail
CKPT=${1:?usage: serve_p150x2.sh CHECKPOINT_DIR [K]}
K=${2:-0}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ -f "$CKPT/config.json" ] || { echo "serve_p150x2: $CKPT has no config.json (pass a local checkpoint directory)" >&2; exit 1; }
spec=()
depth=""
# prefix caching (a plain launch): vLLM reuses cached KV blocks and the model restores its GDN checkpoints
# (docs/vllm_prefix.md); vLLM requires chunked prefill on with it for a hybrid architecture, and the plugin turns
# chunked prefill off again for this model type. A speculative launch refuses prefix caching (spec_plan).
apc=(--enable-prefix-caching --enable-chunked-prefill)
if [ "$K" = auto ]; then
  K=7  # the deepest step (the depth policy's tables cover 1..7): the verify block width vLLM reserves
  depth=', "spec_depth": "auto"'
fi
if [ "$K" -gt 0 ]; then
  apc=(--no-enable-prefix-caching --no-enable-chunked-prefill)
  spec=(--speculative-config "{\"method\": \"custom_class\", \"model\": \"vllm_tt_plugin.model_owned_drafter\", \"num_speculative_tokens\": $K}")
fi
export MESH_DEVICE=P150x2
export EXTRA_MODELS_DIR="$REPO/vllm_models"
# vLLM 0.25.1 waits this long for the engine core's READY message, which comes after weight conversion, KV
# allocation, warmup and trace capture (default 600 s; a first 27B start may need more: docs/serving.md)
export VLLM_ENGINE_READY_TIMEOUT_S=${VLLM_ENGINE_READY_TIMEOUT_S:-3600}
exec vllm serve "$CKPT" \
  --served-model-name qwen36 \
  --max-num-seqs 1 \
  --max-model-len "${MAX_MODEL_LEN:-32768}" \
  --max-num-batched-tokens "${MAX_MODEL_LEN:-32768}" \
  --block-size 64 \
  "${apc[@]}" \
  --no-async-scheduling \
  --additional-config "{\"tt\": {\"trace_mode\": \"all\", \"optimizations\": \"performance\", \"trace_region_size\": 67108864, \"fabric_config\": \"FABRIC_1D\"$depth}}" \
  "${spec[@]}" \
  --port "${PORT:-8000}"
