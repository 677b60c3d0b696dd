"""Rollout backends: `hf` (transformers, catch-up kernel) and `vllm` (GPU, optional)."""
