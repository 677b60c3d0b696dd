"""Secrets stay out of every artifact: redaction of secret values (W&B, HF and other tokens) in recorded data.

Secrets come from the environment only (`WANDB_API_KEY`, `HF_TOKEN`, ...; no params key holds one). Anything
the pipeline records about its run (report metadata, metrics, logs) passes through `redact`, which replaces
the value of every secret-looking environment variable wherever it appears in a string, and the value of
every secret-looking key in a mapping, with `REDACTED`. `RedactingFilter` does the same for log records.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Mapping

REDACTED = "<redacted>"
# names of environment variables that hold secrets (TOKENIZERS_PARALLELISM does not: the pattern is anchored)
SECRET_NAME = re.compile(r"(TOKEN|_KEY|APIKEY|PASSWORD|PASSWD|CREDENTIALS?)$|SECRET")
# lower-case mapping keys that hold secrets (pad_token, max_new_tokens and the like are ordinary keys)
SECRET_KEYS = {"api_key", "hub_token", "auth_token", "access_token", "password", "secret", "wandb_api_key",
               "hf_token"}
KNOWN_SECRETS = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_TOKEN", "PREFECT_API_KEY",
                 "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "GITHUB_TOKEN")
MIN_SECRET_CHARS = 6  # shorter values ("1", "true") would redact ordinary text


def is_secret_name(name: str) -> bool:
    """An environment variable name that holds a secret."""
    return name in KNOWN_SECRETS or bool(SECRET_NAME.search(name.upper()))


def is_secret_key(key: str) -> bool:
    """A mapping key that holds a secret: an upper-case environment-style name, or a known lower-case one."""
    return (key.isupper() and is_secret_name(key)) or key.lower() in SECRET_KEYS


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of the secret-named environment variables, longest first (so a prefix never wins)."""
    env = os.environ if environ is None else environ
    vals = {v for k, v in env.items() if is_secret_name(k) and isinstance(v, str) and len(v) >= MIN_SECRET_CHARS}
    return sorted(vals, key=len, reverse=True)


def redact_text(text: str, secrets: list[str] | None = None) -> str:
    for s in secret_values() if secrets is None else secrets:
        if s in text:
            text = text.replace(s, REDACTED)
    return text


def redact(obj: Any, secrets: list[str] | None = None) -> Any:
    """A copy of `obj` (JSON-like: dicts, lists, strings, numbers) with every secret removed."""
    secrets = secret_values() if secrets is None else secrets
    if isinstance(obj, str):
        return redact_text(obj, secrets)
    if isinstance(obj, Mapping):
        return {k: (REDACTED if isinstance(k, str) and is_secret_key(k) and v not in (None, "")
                    else redact(v, secrets)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v, secrets) for v in obj)
    return obj


class RedactingFilter(logging.Filter):
    """Removes secret values from a log record's message and arguments before any handler writes it."""

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = secret_values()
        if not secrets:
            return True
        msg = record.getMessage()
        clean = redact_text(msg, secrets)
        if clean != msg:
            record.msg, record.args = clean, None
        return True
