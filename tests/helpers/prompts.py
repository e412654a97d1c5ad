"""Deterministic prompts of chosen lengths for the tests."""

from __future__ import annotations

PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when movable "
    "type made books cheaper and faster to produce. Within decades, printers in many "
    "European cities were publishing bibles, grammars, calendars and news sheets, and "
    "the spread of ideas accelerated in science, religion and politics. Scholars argue "
    "about how quickly literacy rose, but few doubt that the press changed how people "
    "learned, argued and remembered. "
)


def long_text(approx_words: int) -> str:
    words = (PARAGRAPH * (approx_words // 60 + 1)).split()
    return " ".join(words[:approx_words])


# Text prompts from a few tokens to several KV blocks (128 tokens each on CPU).
TEXT_PROMPTS = [
    "Hello, my name is",
    "Write a short poem about the sea.",
    long_text(120) + " Summarize the passage above in one sentence:",
    long_text(400) + " What is this text about?",
    long_text(900) + " Continue the story:",
]


def prompt_of_length(tokenizer, n_tokens: int, salt: str = "") -> list[int]:  # type: ignore[no-untyped-def]
    """Exactly `n_tokens` token ids of natural text (`salt` makes a distinct prompt)."""
    ids: list[int] = list(tokenizer.encode(salt + " " + long_text(n_tokens + 50)))
    while len(ids) < n_tokens:
        ids += ids
    return ids[:n_tokens]
