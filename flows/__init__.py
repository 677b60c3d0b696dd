"""Prefect flows composing the stages."""
