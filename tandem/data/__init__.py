"""Datasets: synthetic arithmetic generation, prompt rendering, validation and jsonl I/O."""
