"""Qwen3.6 (hybrid Gated-DeltaNet / gated attention) with MTP speculative decoding."""
from pathlib import Path

# the small checkpoint shipped inside the package (see its MODEL_CARD.md); the command line and the lossless probe
# default to it
DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "default_checkpoint"
