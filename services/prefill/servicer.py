"""The prefill worker's gRPC service: run the prompt, sample the first token, ship the
prompt's KV to the decode worker named in the request (the connector does the
shipping, layer by layer, during the forward pass)."""

from __future__ import annotations

import logging
import time

import grpc

from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wpb_grpc
from services.api import validation
from services.api.backend import GenerationRequest, delta_from_output, vllm_params
from services.api.server import Service
from services.api.servicer import finish_reason_pb, logprob_messages
from services.kv.params import FAULTS, send_params
from services.workers import Worker

log = logging.getLogger(__name__)

SERVICE = wpb.DESCRIPTOR.services_by_name["PrefillService"].full_name


def check_fault(fault: str, allowed: bool) -> None:
    if fault not in FAULTS:
        raise validation.invalid(f"fault: {fault!r} is not one of {FAULTS[1:]}")
    if fault and not allowed:
        raise validation.RequestError(
            grpc.StatusCode.PERMISSION_DENIED,
            "fault: fault injection is off on this worker (--allow-fault-injection)",
        )


class PrefillServicer(wpb_grpc.PrefillServiceServicer):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        facts = worker.engine.facts
        self.limits = validation.Limits(facts.name, facts.max_model_len, facts.vocab_size)

    def _check(self, req: wpb.PrefillRequest) -> GenerationRequest:
        ids = list(req.prompt_token_ids)
        validation.check_token_ids(ids, self.limits, "prompt_token_ids")
        if len(ids) >= self.limits.max_model_len:
            raise validation.invalid(
                f"prompt_token_ids: {len(ids)} tokens do not fit the context of "
                f"{self.limits.max_model_len}")
        kwargs = validation.sampling_kwargs(req.sampling, self.limits)
        t = req.target
        if not (req.transfer_id and t.worker_id and t.kv_address):
            raise validation.invalid("transfer_id, target.worker_id and target.kv_address "
                                     "are required")
        mine = self.worker.fingerprint.digest()
        if t.fingerprint_digest != mine:
            raise validation.RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"target: decode worker {t.worker_id} has KV layout {t.fingerprint_digest}, "
                f"this prefill worker {mine} ({self.worker.fingerprint.to_dict()}); pair "
                "workers that serve the same model with the same dtype, block size and "
                "attention layout")
        check_fault(req.fault, self.worker.config.allow_fault_injection)
        return GenerationRequest(req.request_id, ids, req.sampling, kwargs, 1)

    async def Prefill(self, req: wpb.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> wpb.PrefillResponse:
        try:
            greq = self._check(req)
        except validation.RequestError as e:
            await context.abort(e.code, e.message)
        t = req.target
        kv_params = send_params(req.transfer_id, t.kv_address, t.kv_transport or "grpc",
                                int(t.epoch), t.fingerprint_digest, req.fault)
        # Only the first token here; the decode worker generates the rest. A client's
        # min_tokens keeps EOS from ending the answer at token 1.
        overrides = {"min_tokens": min(1, greq.sampling_kwargs.get("min_tokens", 0)),
                     "extra_args": {"kv_transfer_params": kv_params}}
        params = vllm_params(greq, 1, **overrides)
        start_wall = time.time()
        last = None
        async for out in self.worker.engine.generate(greq.prompt_token_ids, params,
                                                     req.request_id or req.transfer_id):
            last = out
        done_wall = time.time()
        if last is None or not last.outputs[0].token_ids:
            await context.abort(grpc.StatusCode.ABORTED, "prefill was aborted")
        assert last is not None
        delta = delta_from_output(last)
        resp = wpb.PrefillResponse(
            first_token_id=delta.token_ids[0], first_token_text=delta.text,
            # "length" here only means max_tokens=1 was reached; "stop" ends the answer.
            finished=delta.finish_reason == "stop",
            finish_reason=finish_reason_pb(delta),
            stop_reason="" if delta.stop_reason is None else str(delta.stop_reason),
            queue_s=delta.timings.get("queue_s", 0.0),
            prefill_s=delta.timings.get("prefill_s", 0.0),
            cached_tokens=delta.num_cached_tokens,
            handle=wpb.TransferHandle(
                transfer_id=req.transfer_id, prefill_worker_id=self.worker.identity.worker_id,
                prefill_epoch=self.worker.identity.epoch,
                num_tokens=len(greq.prompt_token_ids), decode_epoch=t.epoch,
                prefill_start_wall=start_wall, prefill_done_wall=done_wall,
            ),
            logprobs=logprob_messages(delta),
        )
        return resp

    async def GetWorkerInfo(self, req: wpb.GetWorkerInfoRequest,
                            context: grpc.aio.ServicerContext) -> wpb.WorkerInfo:
        return self.worker.info()


def prefill_service(worker: Worker) -> Service:
    servicer = PrefillServicer(worker)
    return Service(SERVICE, lambda server: wpb_grpc.add_PrefillServiceServicer_to_server(
        servicer, server))
