"""Tandem rollouts: a senior and a junior co-generate over one shared token history (see engine.py)."""
