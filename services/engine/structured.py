"""Structured outputs (vLLM's output constraints) across processes and engines.

Two things live here:

- `check_structured`: compile-check a constraint the way the engine will (vLLM's own
  xgrammar validation), so a bad schema, regex or grammar is refused as the client's
  error, naming the field, before it reaches any engine. Every pdserve engine uses the
  xgrammar backend (`BACKEND`), so what passes here compiles there, and the prefill and
  decode engines of one request split the answer into the same tokens.

- Resuming a constraint mid-answer. vLLM advances a request's grammar matcher with the
  tokens it samples; prompt tokens never reach it. A decode worker continues an answer
  whose token 1 the prefill worker sampled, and a moved request continues from every
  token the client already has: those tokens arrive as the tail of the prompt (their KV
  is the prompt's). Fed to a fresh matcher nothing, the constraint would restart after
  them (a JSON answer would get a second opening brace). So the engine is asked to
  pre-advance the request's matcher by those prompt-tail tokens, as if it had sampled
  them, right after compiling it: `SamplingParams.extra_args[RESUME_KEY]` says how many.
  vLLM has no public hook for that; `ResumingScheduler` (given to vLLM as its scheduler
  class, run in the engine-core process) wraps the structured-output manager's grammar
  compilation, which runs before the request is first scheduled. A matcher that refuses
  those tokens fails only its request (vLLM finishes it with an error), never the engine.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from services.errors import InvalidRequest
from services.messages import Structured

if TYPE_CHECKING:
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

log = logging.getLogger(__name__)

BACKEND = "xgrammar"  # one backend everywhere: the same constraint, the same tokens
RESUME_KEY = "pdserve_resume_tokens"
SCHEDULER = f"{__name__}.ResumingScheduler"

# The field each kind has in the public API (`SamplingParams.structured`).
FIELDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
          "json_object": "json_object"}


def field_of(st: Structured) -> str:
    return f"sampling.structured.{FIELDS[st.kind]}"


def check_structured(st: Structured) -> None:
    """Compile-check `st` as the engine's xgrammar backend will; raises `InvalidRequest`
    naming the field. Imports vLLM (seconds, once per process: `warm_up` at start)."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    try:
        params = SamplingParams(structured_outputs=StructuredOutputsParams(**st.vllm_kwargs()))
        validate_xgrammar_grammar(params)
    except Exception as e:  # vLLM's refusals are ValueErrors; xgrammar's are RuntimeErrors
        cause = f": {e.__cause__}" if e.__cause__ is not None else ""
        raise InvalidRequest(f"{field_of(st)}: {e}{cause}") from e


def warm_up() -> None:
    """Import what `check_structured` needs, so the first constrained request does not
    wait for it (call in a background thread at start)."""
    try:
        check_structured(Structured("regex", "[0-9]"))
    except Exception:  # only the import matters here; a real request reports errors
        log.debug("structured-output warm-up failed", exc_info=True)


def resume_count(request: Request) -> int:
    params = request.sampling_params
    extra = (params.extra_args or {}) if params is not None else {}
    value = extra.get(RESUME_KEY, 0)
    return value if isinstance(value, int) and 0 < value < len(request.prompt_token_ids) else 0


def resume_grammars(manager: StructuredOutputManager) -> None:
    """Make `manager` pre-advance each new grammar by its request's resumed tokens."""
    compile_grammar = manager._create_grammar

    def compile_resumed(request: Request) -> Any:
        grammar = compile_grammar(request)
        n = resume_count(request)
        if n:
            tokens = list(request.prompt_token_ids[-n:])
            if not grammar.accept_tokens(request.request_id, tokens):
                raise ValueError(f"the output constraint refuses the {n} tokens the answer "
                                 "already has; it cannot resume")
        return grammar

    manager._create_grammar = compile_resumed


class ResumingScheduler:
    """vLLM's own scheduler (the async one when vLLM chose async scheduling), whose
    structured-output manager resumes constraints (`resume_grammars`). vLLM builds its
    scheduler by calling the configured class; this one hands back vLLM's."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler

        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        base = AsyncScheduler if vllm_config.scheduler_config.async_scheduling else Scheduler
        scheduler = base(*args, **kwargs)
        resume_grammars(scheduler.structured_output_manager)
        return scheduler
