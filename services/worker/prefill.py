"""The prefill worker's gRPC service: run the prompt, sample the first token, ship the
prompt's KV to the decode worker named in the request (the connector does the
shipping, layer by layer, during the forward pass). The blocks of the prompt's first
`reuse_tokens`, which the decode worker holds already, stay here (`services.kv.reuse`);
the transfer handle names the first block shipped. At tensor-parallel size N each rank
ships its KV heads to the decode worker's ranks that hold them (`target.kv_addresses`),
and the handle names N, so each decode rank knows which pieces to wait for."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc

from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wpb_grpc
from services import wire
from services.engine.outputs import delta_of_output, vllm_params
from services.errors import Aborted, InvalidRequest
from services.kv.params import SendParams, check_fault
from services.kv.reuse import first_block
from services.limits import Limits
from services.messages import Sampling
from services.observability import tracing
from services.observability.request_spans import NULL_PREFILL, PrefillSpan, prefill_span
from services.observability.spans import error_type
from services.server.grpc_server import Service
from services.worker import checks, kv_events
from services.worker.worker import Worker

log = logging.getLogger(__name__)

SERVICE = wpb.DESCRIPTOR.services_by_name["PrefillService"].full_name


class PrefillServicer(wpb_grpc.PrefillServiceServicer):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        facts = worker.engine.facts
        self.limits = Limits(facts.name, facts.max_model_len, facts.vocab_size)

    def _check(self, req: wpb.PrefillRequest) -> None:
        checks.check_id("request_id", req.request_id)
        checks.check_id("transfer_id", req.transfer_id)
        checks.check_prompt(list(req.prompt_token_ids), self.limits, "prompt_token_ids")
        if req.generated_tokens >= len(req.prompt_token_ids):
            raise InvalidRequest(f"generated_tokens: {req.generated_tokens} must be fewer than "
                                 f"the {len(req.prompt_token_ids)} prompt tokens")
        if req.sampling.max_tokens != 1:
            raise InvalidRequest(f"sampling.max_tokens: {req.sampling.max_tokens}; a prefill "
                                 "request produces exactly one token")
        fp = self.worker.fingerprint
        checks.check_target(req.target, fp.digest(), str(fp.to_dict()))
        check_fault(req.fault, self.worker.config.allow_fault_injection)
        self._first_block(req)

    def _first_block(self, req: wpb.PrefillRequest) -> int:
        """The prompt block the transfer starts at (InvalidRequest for a bad hint)."""
        try:
            return first_block(req.reuse_tokens, len(req.prompt_token_ids),
                               self.worker.fingerprint.block_size)
        except ValueError as e:
            raise InvalidRequest(f"{e}; send the decode worker's cached prefix in whole "
                                 "blocks, or 0 to ship every block") from None

    async def Prefill(self, req: wpb.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> wpb.PrefillResponse:
        me = self.worker.identity
        span = prefill_span(req.request_id, len(req.prompt_token_ids), me.worker_id, me.epoch,
                            tracing.extract_grpc(context.invocation_metadata()))
        try:
            self._check(req)
            sampling, _ = checks.check_sampling(req.sampling, self.limits,
                                                len(req.prompt_token_ids))
            return await self._prefill(req, sampling, span)
        except Exception as e:
            span.fail(e, error_type(e))
            raise
        finally:
            span.end()

    async def _prefill(self, req: wpb.PrefillRequest, sampling: Sampling,
                       span: PrefillSpan = NULL_PREFILL) -> wpb.PrefillResponse:
        t = req.target
        first = self._first_block(req)
        kv_params = SendParams(req.transfer_id, t.kv_address, t.kv_transport, int(t.epoch),
                               t.fingerprint_digest, req.fault, same_host=t.same_host,
                               first_block=first,
                               kv_addresses=tuple(t.kv_addresses)).to_params()
        params = vllm_params(sampling, 1, extra_args={"kv_transfer_params": kv_params},
                             resume_tokens=req.generated_tokens)
        prompt = list(req.prompt_token_ids)
        lora = self.worker.engine.lora_request(req.lora_name)
        start_wall = time.time()
        last = None
        async for out in self.worker.engine.generate(prompt, params, req.request_id, lora):
            last = out
        done_wall = time.time()
        if last is None or not last.outputs[0].token_ids:
            raise Aborted("prefill was aborted")
        delta = delta_of_output(last)
        span.done(delta.timings.queue_s, delta.timings.prefill_s, delta.num_cached_tokens,
                  done_wall, start_wall)
        return wpb.PrefillResponse(
            first_token_id=delta.token_ids[0], first_token_text=delta.text,
            # "length" here only means max_tokens=1 was reached; "stop" ends the answer.
            finished=delta.finish_reason == "stop",
            finish_reason=wire.finish_reason_pb(delta.finish_reason),
            stop_reason="" if delta.stop_reason is None else str(delta.stop_reason),
            queue_s=delta.timings.queue_s, prefill_s=delta.timings.prefill_s,
            cached_tokens=delta.num_cached_tokens,
            handle=wpb.TransferHandle(
                transfer_id=req.transfer_id, prefill_worker_id=self.worker.identity.worker_id,
                prefill_epoch=self.worker.identity.epoch, num_tokens=len(prompt),
                decode_epoch=t.epoch, prefill_start_wall=start_wall,
                prefill_done_wall=done_wall, lora_name=req.lora_name, first_block=first,
                prefill_tp=self.worker.engine.config.tensor_parallel_size,
            ),
            logprobs=wire.logprobs_pb(delta.logprobs),
        )

    async def GetWorkerInfo(self, req: wpb.GetWorkerInfoRequest,
                            context: grpc.aio.ServicerContext) -> wpb.WorkerInfo:
        return self.worker.info()

    async def WatchKVEvents(self, req: wpb.WatchKVEventsRequest,
                            context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[wpb.WatchKVEventsResponse]:
        async for batch in kv_events.watch(self.worker.kv_events, context):
            yield batch


def prefill_service(worker: Worker) -> Service:
    servicer = PrefillServicer(worker)
    return Service(SERVICE, lambda server: wpb_grpc.add_PrefillServiceServicer_to_server(
        servicer, server))
