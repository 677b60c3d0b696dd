r"""Problem -> prompt text: the problem plus the `\boxed{}` instruction, through the chat template if any.

Prepared data stores the user message (`user_message`); the chat template is applied when a model reads it
(`render_prompt`), because the tiny model's tokenizer is built after the data is prepared.
"""

from __future__ import annotations

from typing import Any

INSTRUCTION = "Solve step by step and put the final answer in \\boxed{}."


def user_message(problem: str) -> str:
    """The user turn for one problem: problem text, a blank line, then the answer-format instruction."""
    return f"{problem.strip()}\n\n{INSTRUCTION}"


def render_prompt(message: str, tokenizer: Any = None) -> str:
    """Render a user message for generation: the tokenizer's chat template when it has one, else plain text."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True)
    return message + "\n\n"
