"""From a public request to a `GenerationRequest`: the one path every front end (gRPC,
HTTP) takes, so validation, prompt rendering, ids, deadlines and client identity cannot
differ between them."""

from __future__ import annotations

import uuid
from collections.abc import Collection
from typing import TYPE_CHECKING

from pdserve.v1 import generate_pb2 as pb
from services import limits as model_limits
from services.api import validation
from services.api.prompts import render
from services.engine.engine import ModelFacts
from services.engine.structured import check_structured
from services.messages import GenerationRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def prepare(request: pb.GenerateRequest, limits: model_limits.Limits,
            tokenizer: PreTrainedTokenizerBase, timeout_s: float | None = None,
            client_id: str = "", adapters: Collection[str] = ()) -> GenerationRequest:
    """Validate and tokenize; raises `InvalidRequest`/`ModelNotFound` naming the bad
    field. Every request gets its own id: the client's `request_id` is only echoed, so
    two clients that pick the same one never touch each other's requests. A `model`
    among `adapters` (the LoRA adapters served) runs under that adapter."""
    validation.check_request_id(request.request_id)
    lora = request.model if request.model in adapters else ""
    if not lora:
        validation.check_model(request.model, limits)
    prompt = validation.check_input(request, limits)
    sampling = model_limits.check_sampling(request.sampling, limits)
    if sampling.structured is not None:  # refused here, never by an engine
        check_structured(sampling.structured)
    prompt_ids = render(prompt, tokenizer,
                        request.chat if request.WhichOneof("input") == "chat" else None)
    max_tokens = model_limits.resolve_max_tokens(sampling, len(prompt_ids), limits)
    return GenerationRequest(uuid.uuid4().hex, prompt_ids, sampling, max_tokens, timeout_s,
                             client_id, request.request_id, lora=lora)


def limits_of(facts: ModelFacts) -> model_limits.Limits:
    return model_limits.Limits(facts.name, facts.max_model_len, facts.vocab_size)
