"""From a public request to a `GenerationRequest`: the one path every front end (gRPC,
HTTP) takes, so validation and prompt rendering cannot differ between them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.v1 import generate_pb2 as pb
from services.api import validation
from services.api.backend import GenerationRequest
from services.api.prompts import render
from services.engine.engine import ModelFacts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def prepare(request: pb.GenerateRequest, request_id: str, limits: validation.Limits,
            tokenizer: PreTrainedTokenizerBase, timeout_s: float | None = None,
            client_id: str = "") -> GenerationRequest:
    """Validate and tokenize; raises `validation.RequestError` naming the bad field."""
    validation.check_request_id(request.request_id)
    validation.check_model(request.model, limits)
    prompt = validation.check_input(request, limits)
    kwargs = validation.sampling_kwargs(request.sampling, limits)
    prompt_ids = render(prompt, tokenizer)
    max_tokens = validation.resolve_max_tokens(request.sampling, len(prompt_ids), limits)
    return GenerationRequest(request_id, prompt_ids, request.sampling, kwargs, max_tokens,
                             timeout_s, client_id)


def limits_of(facts: ModelFacts) -> validation.Limits:
    return validation.Limits(facts.name, facts.max_model_len, facts.vocab_size)
