"""The public gRPC generation service: a thin shell that converts protobuf to the
backend's terms and back (`services/wire.py`). Validation lives in `validation`, prompt
rendering in `prompts`, the serving itself in a `Backend`, the status of every failure
in `services/errors.py` (answered by the server's error interceptor,
`services/server/errors.py`: handlers here raise)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
from google.protobuf.message import DecodeError

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc as pb_grpc
from services import wire
from services.api.backend import Backend
from services.api.models import ServedModel
from services.api.prepare import prepare
from services.errors import Aborted, InvalidRequest
from services.observability import tracing
from services.security.apikeys import client_id
from services.server.grpc_server import Service

log = logging.getLogger(__name__)

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name


def parse_request(data: bytes) -> pb.GenerateRequest | InvalidRequest:
    """The request deserializer: bytes that are not a GenerateRequest are the client's
    error, handed to the servicer to answer INVALID_ARGUMENT with."""
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as e:
        return InvalidRequest(f"request: not a pdserve.v1.GenerateRequest ({e})")


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    async def Generate(
        self, request: pb.GenerateRequest | InvalidRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse | bytes]:
        started = time.monotonic()
        if isinstance(request, InvalidRequest):
            raise request
        metadata = dict(context.invocation_metadata() or ())
        req, _ = prepare(request, self.backend.served_models(), context.time_remaining(),
                         client_id(str(metadata.get("x-client-id", ""))))
        if tracing.enabled():  # the client's traceparent: its trace continues here
            req = replace(req, trace_headers=tracing.carried(metadata.items()))
        completion_tokens = 0
        ttft_s = 0.0
        stream = self.backend.generate(req)
        try:
            async for delta in stream:
                if wire.is_chunk(delta):
                    if completion_tokens == 0 and delta.token_ids:
                        ttft_s = time.monotonic() - started
                    completion_tokens += len(delta.token_ids)
                    yield wire.chunk_out(delta)
                if delta.finished:
                    delta.timings.ttft_s = ttft_s
                    delta.timings.e2e_s = time.monotonic() - started
                    yield wire.final_pb(delta, request.request_id or req.request_id,
                                        len(req.prompt_token_ids), completion_tokens)
                    return
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        # The engine stream ended without a finished output: it was aborted.
        raise Aborted("the request was aborted by the server")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        models = [model_info(m) for m in self.backend.served_models()]
        default = models[0] if models else pb.ModelInfo()
        # The one-model fields describe the default model, as before there were several;
        # `lora_adapters` lists every adapter, each naming its base model.
        info = pb.GetModelInfoResponse(
            model=default.model,
            max_model_len=default.max_model_len,
            vocab_size=default.vocab_size,
            eos_token_ids=list(default.eos_token_ids),
            has_chat_template=default.has_chat_template,
            tokenizer=default.tokenizer,
            dtype=default.dtype,
            serving_mode=self.backend.mode,
            lora_adapters=[a for m in models for a in m.lora_adapters],
            models=models,
        )
        if default.HasField("bos_token_id"):
            info.bos_token_id = default.bos_token_id
        return info

    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext
                              ) -> pb.LoadLoraAdapterResponse:
        await self.backend.load_adapter(request.lora_name, request.lora_path)
        return pb.LoadLoraAdapterResponse(message=lora_loaded(request.lora_name))

    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext
                                ) -> pb.UnloadLoraAdapterResponse:
        await self.backend.unload_adapter(request.lora_name)
        return pb.UnloadLoraAdapterResponse(message=lora_unloaded(request.lora_name))


def model_info(m: ServedModel) -> pb.ModelInfo:
    f = m.facts
    info = pb.ModelInfo(
        model=f.name, max_model_len=f.max_model_len, vocab_size=f.vocab_size,
        eos_token_ids=list(f.eos_token_ids), has_chat_template=f.has_chat_template,
        tokenizer=f.tokenizer_class, dtype=f.dtype,
        lora_adapters=[pb.LoraAdapter(name=name, parent=f.name, path=path)
                       for name, path in m.adapters.items()])
    if f.bos_token_id is not None:
        info.bos_token_id = f.bos_token_id
    return info


# vLLM's answers to its load and unload endpoints, word for word.
def lora_loaded(name: str) -> str:
    return f"Success: LoRA adapter '{name}' added successfully."


def lora_unloaded(name: str) -> str:
    return f"Success: LoRA adapter '{name}' removed successfully."


def generation_service(backend: Backend) -> Service:
    servicer = GenerationServicer(backend)
    # As the generated `add_GenerationServiceServicer_to_server`, but requests that do not
    # parse reach the servicer as an error to answer INVALID_ARGUMENT with (grpc would
    # answer a deserializer's exception with an opaque UNKNOWN), and chunks forwarded
    # from a worker go out as the bytes they came in.
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=parse_request,
            response_serializer=wire.serialize_response),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, request_deserializer=pb.GetModelInfoRequest.FromString,
            response_serializer=pb.GetModelInfoResponse.SerializeToString),
        "LoadLoraAdapter": grpc.unary_unary_rpc_method_handler(
            servicer.LoadLoraAdapter, request_deserializer=pb.LoadLoraAdapterRequest.FromString,
            response_serializer=pb.LoadLoraAdapterResponse.SerializeToString),
        "UnloadLoraAdapter": grpc.unary_unary_rpc_method_handler(
            servicer.UnloadLoraAdapter,
            request_deserializer=pb.UnloadLoraAdapterRequest.FromString,
            response_serializer=pb.UnloadLoraAdapterResponse.SerializeToString),
    }
    generic = grpc.method_handlers_generic_handler(GENERATION_SERVICE, handlers)
    return Service(GENERATION_SERVICE, lambda server: server.add_generic_rpc_handlers((generic,)))
