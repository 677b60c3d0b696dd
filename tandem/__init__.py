"""tandem: Tandem Reinforcement Learning as a reproducible pipeline."""
