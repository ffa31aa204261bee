"""Qwen3.6 (hybrid Gated-DeltaNet / gated attention) with MTP speculative decoding."""
