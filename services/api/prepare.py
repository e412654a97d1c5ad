"""From a public request to a `GenerationRequest`: the one path every front end (gRPC,
HTTP) takes, so validation, prompt rendering, ids, deadlines and client identity cannot
differ between them."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from pdserve.v1 import generate_pb2 as pb
from services import limits as model_limits
from services.api import validation
from services.api.models import Resolved, ServedModel, resolve
from services.api.prompts import render
from services.engine.structured import check_structured
from services.messages import GenerationRequest


def prepare(request: pb.GenerateRequest, models: Sequence[ServedModel],
            timeout_s: float | None = None, client_id: str = "") -> tuple[GenerationRequest,
                                                                          Resolved]:
    """Validate and tokenize; raises `InvalidRequest`/`ModelNotFound` naming the bad
    field. Every request gets its own id: the client's `request_id` is only echoed, so
    two clients that pick the same one never touch each other's requests. `model` picks
    one of `models` (the default, the first, when empty), or a LoRA adapter of one, run
    under that adapter; the request is checked against and rendered for that model,
    which is returned with it."""
    validation.check_request_id(request.request_id)
    resolved = resolve(models, request.model)
    limits, tokenizer = resolved.model.limits, resolved.model.tokenizer
    prompt = validation.check_input(request, limits)
    sampling = model_limits.check_sampling(request.sampling, limits)
    if sampling.structured is not None:  # refused here, never by an engine
        check_structured(sampling.structured)
    prompt_ids = render(prompt, tokenizer,
                        request.chat if request.WhichOneof("input") == "chat" else None)
    max_tokens = model_limits.resolve_max_tokens(sampling, len(prompt_ids), limits)
    req = GenerationRequest(uuid.uuid4().hex, prompt_ids, sampling, max_tokens, timeout_s,
                            client_id, request.request_id, lora=resolved.lora,
                            model=resolved.model.name)
    return req, resolved

