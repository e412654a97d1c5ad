"""The decode worker's gRPC service: continue a prefilled request from its shipped KV
and stream tokens 2..n."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from prometheus_client import Counter, Histogram

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wpb_grpc
from services.api import validation
from services.api.backend import Delta, GenerationRequest, delta_from_output, vllm_params
from services.api.server import Service
from services.api.servicer import chunk_message, finish_reason_pb
from services.kv.params import LOAD_KEY, recv_params
from services.prefill.servicer import check_fault
from services.workers import Worker

log = logging.getLogger(__name__)

SERVICE = wpb.DESCRIPTOR.services_by_name["DecodeService"].full_name

KV_BYTES = Counter("pdserve_kv_transfer_bytes", "KV bytes received from prefill workers")
KV_SECONDS = Histogram("pdserve_kv_transfer_seconds", "first to last KV byte of a transfer",
                       buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
KV_FAILURES = Counter("pdserve_kv_transfer_failures", "KV transfers that could not be used "
                      "(corrupt, late, missing, stale); recomputed or failed by policy",
                      ["policy"])


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


class DecodeServicer(wpb_grpc.DecodeServiceServicer):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        facts = worker.engine.facts
        self.limits = validation.Limits(facts.name, facts.max_model_len, facts.vocab_size)
        self.policy = worker.config.kv_load_failure_policy

    def _check(self, req: wpb.DecodeRequest) -> GenerationRequest:
        local = not req.HasField("handle")  # no prefill worker: prefill here
        ids = [*req.prompt_token_ids] if local else [*req.prompt_token_ids, req.first_token_id]
        validation.check_token_ids(ids, self.limits, "prompt_token_ids + first_token_id")
        kwargs = validation.sampling_kwargs(req.sampling, self.limits)
        max_tokens = validation.resolve_max_tokens(req.sampling, len(ids), self.limits)
        h = req.handle
        if not local and not h.transfer_id:
            raise validation.invalid("handle.transfer_id: required")
        if h.num_tokens > len(req.prompt_token_ids):
            raise validation.invalid(
                f"handle.num_tokens: {h.num_tokens} is more than the prompt's "
                f"{len(req.prompt_token_ids)} tokens")
        check_fault(req.fault, self.worker.config.allow_fault_injection)
        return GenerationRequest(req.request_id, ids, req.sampling, kwargs, max_tokens)

    def _stale(self, h: wpb.TransferHandle) -> str:
        epoch = self.worker.identity.epoch
        if h.decode_epoch != epoch:
            return (f"stale transfer handle {h.transfer_id}: its KV was sent to epoch "
                    f"{h.decode_epoch} of this worker, which restarted (epoch {epoch})")
        return ""

    async def Decode(self, req: wpb.DecodeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            greq = self._check(req)
        except validation.RequestError as e:
            await context.abort(e.code, e.message)
        h = req.handle
        extra: dict[str, Any] = {}
        stale = self._stale(h) if req.HasField("handle") else ""
        if not req.HasField("handle"):
            pass  # prefilled here (conditional disaggregation): nothing to receive
        elif stale:
            KV_FAILURES.labels(self.policy).inc()
            if self.policy == "fail":
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, stale)
            log.warning("%s; recomputing the prompt", stale)
        else:
            extra = {"kv_transfer_params": recv_params(h.transfer_id, h.num_tokens, req.fault)}
        params = vllm_params(greq, extra_args=extra)
        async for out in self.worker.engine.generate(greq.prompt_token_ids, params,
                                                     req.request_id or h.transfer_id):
            delta = delta_from_output(out)
            if delta.token_ids or delta.text:
                yield chunk_message(delta)
            if not delta.finished:
                continue
            if delta.finish_reason == "error":
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    "the prompt's KV transfer failed and the KV load failure "
                                    "policy is 'fail'; retry the request")
            yield pb.GenerateResponse(final=self._final(delta, out, h))
            return
        await context.abort(grpc.StatusCode.ABORTED, "the request was aborted by the server")

    def _final(self, delta: Delta, out: Any, h: wpb.TransferHandle) -> pb.Final:
        timings = pb.Timings(decode_queue_s=delta.timings.get("queue_s", 0.0),
                             decode_s=delta.timings.get("prefill_s", 0.0)
                             + delta.timings.get("decode_s", 0.0))
        if not h.transfer_id:  # prefilled here: report the phases as the colocated mode does
            t = delta.timings
            timings = pb.Timings(queue_s=t.get("queue_s", 0.0), prefill_s=t.get("prefill_s", 0.0),
                                 decode_s=t.get("decode_s", 0.0))
        report = (getattr(out, "kv_transfer_params", None) or {}).get(LOAD_KEY)
        if report is not None:
            if report["ok"]:
                first, last = report["first_byte_wall"], report["last_byte_wall"]
                timings.kv_transfer_s = max(0.0, last - first)
                timings.kv_transfer_bytes = int(report["bytes"])
                timings.kv_transfer_hidden_s = overlap(
                    first, last, h.prefill_start_wall, h.prefill_done_wall)
                KV_BYTES.inc(report["bytes"])
                KV_SECONDS.observe(timings.kv_transfer_s)
            else:
                KV_FAILURES.labels(self.policy).inc()
        stop = delta.stop_reason
        return pb.Final(
            finish_reason=finish_reason_pb(delta),
            stop_reason="" if stop is None else str(stop),
            usage=pb.Usage(cached_tokens=delta.num_cached_tokens),
            timings=timings,
        )

    async def GetWorkerInfo(self, req: wpb.GetWorkerInfoRequest,
                            context: grpc.aio.ServicerContext) -> wpb.WorkerInfo:
        return self.worker.info()


def decode_service(worker: Worker) -> Service:
    servicer = DecodeServicer(worker)
    return Service(SERVICE, lambda server: wpb_grpc.add_DecodeServiceServicer_to_server(
        servicer, server))
