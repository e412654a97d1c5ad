"""A bound on what waits in an engine. vLLM's own queue is unbounded: under overload
every request would wait ever longer instead of being told to come back. A request
counts as queued from its arrival to its first output."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter

from services.errors import Overloaded

REFUSED = Counter("pdserve_engine_admission_rejections", "requests an engine refused "
                  "because its queue was full", ["bound"])
RETRY_AFTER_MS = 500


@dataclass
class Admission:
    max_requests: int  # 0 = no bound
    max_prompt_tokens: int  # 0 = no bound
    requests: int = 0
    prompt_tokens: int = 0

    def enter(self, prompt_tokens: int) -> None:
        """Count a request in, or raise `Overloaded`. A lone request is always let in,
        so a prompt larger than the token bound is refused by its length check, not
        here."""
        if self.max_requests and self.requests >= self.max_requests:
            REFUSED.labels("requests").inc()
            raise Overloaded(f"the engine has {self.requests} requests queued (bound "
                             f"{self.max_requests})", RETRY_AFTER_MS)
        if (self.max_prompt_tokens and self.requests
                and self.prompt_tokens + prompt_tokens > self.max_prompt_tokens):
            REFUSED.labels("prompt_tokens").inc()
            raise Overloaded(f"the engine has {self.prompt_tokens} prompt tokens queued "
                             f"(bound {self.max_prompt_tokens})", RETRY_AFTER_MS)
        self.requests += 1
        self.prompt_tokens += prompt_tokens

    def leave(self, prompt_tokens: int) -> None:
        self.requests -= 1
        self.prompt_tokens -= prompt_tokens
