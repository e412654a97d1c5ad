"""``RequestSpec``: one request a workload asks for, before it is sent."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestSpec:
    """One request of a workload."""

    prompt_ids: list[int]  # the exact prompt, in the model's token ids
    output_len: int  # max_tokens; sent with ignore_eos so the server produces exactly this
    kind: str = "random"  # workload tag ("chat", "long", "sharegpt", ...) for per-kind stats
    prompt_text: str = ""  # the same prompt as text, for servers that only take text
    # A replayed trace's own schedule: the send time, seconds after the run's start
    # (None: the run's arrival process decides), and the index of an earlier request of
    # the same conversation that must have finished before this one is sent.
    at_s: float | None = None
    after: int | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids and not self.prompt_text:
            raise ValueError("a request needs a prompt")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
