"""Rollout backends: `hf` (transformers, catch-up kernel) and `vllm` (turn planning for the rollout service)."""
