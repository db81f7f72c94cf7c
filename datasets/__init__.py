"""Megatron-compatible indexed data, GPT samples, blending, tokenizers, preprocessing."""
