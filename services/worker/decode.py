"""The decode worker's gRPC service: continue a prefilled request from its shipped KV
and stream tokens 2..n; or, without a transfer handle, serve a whole request (prefill
included) as one engine would: conditional disaggregation, a missing prefill pool, a
request migrated here mid-answer."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc
from prometheus_client import Counter, Histogram

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wpb_grpc
from services import wire
from services.engine.outputs import Choices, delta_of_output, end_delta, vllm_params
from services.errors import Aborted, IncompatiblePair, InvalidRequest, Unavailable
from services.kv import worker_ext
from services.kv.params import LoadReport, RecvParams, check_fault
from services.kv.tp_layout import tp_problem
from services.limits import Limits
from services.messages import Delta, Sampling, Timings
from services.observability import tracing
from services.observability.request_spans import (
    DecodeTally,
    KVLoad,
    decode_span,
    finish_decode,
)
from services.observability.spans import error_type
from services.server.grpc_server import Service
from services.worker import checks, kv_events
from services.worker.worker import Worker

log = logging.getLogger(__name__)

SERVICE = wpb.DESCRIPTOR.services_by_name["DecodeService"].full_name

KV_BYTES = Counter("pdserve_kv_transfer_bytes", "KV bytes received from prefill workers")
KV_SECONDS = Histogram("pdserve_kv_transfer_seconds", "first to last KV byte of a transfer",
                       buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
KV_FAILURES = Counter("pdserve_kv_transfer_failures", "KV transfers that could not be used "
                      "(corrupt, late, missing, stale); recomputed or failed by policy",
                      ["policy"])
KV_PROMPT_BYTES = Counter(
    "pdserve_kv_prompt_bytes", "the whole prompt KV of the transfers loaded here, every "
    "block: what shipping it all would have moved (pdserve_kv_transfer_bytes_total is what "
    "was shipped; the difference stayed out, this worker's prefix cache holding it)")
KV_REUSED_TOKENS = Counter(
    "pdserve_kv_reused_prefix_tokens", "prompt tokens of transferred requests this worker "
    "took from its own prefix cache rather than from the transfer")
KV_REUSE_FALLBACKS = Counter(
    "pdserve_kv_reuse_fallbacks", "transferred requests whose prompt this worker computed "
    "itself, the transfer unread, by reason (reused_prefix_gone: it no longer held the "
    "prefix the transfer left out)", ["reason"])
FALLBACK_LOG_EVERY_S = 60.0  # a fallback is logged at most this often, with the count since
# A decode leg whose first step comes this long after its prefill finished is logged with
# where the time went (the router's hand-off, the KV's arrival, the engine's queue), so a
# stall between a stream's first and second token can be told apart after the fact.
SLOW_LEG_LOG_S = 5.0
RELEASED = Counter("pdserve_kv_transfers_released", "transfers released by the router before "
                   "a Decode call took them (the request was cancelled, failed or moved)")


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


class DecodeServicer(wpb_grpc.DecodeServiceServicer):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        facts = worker.engine.facts
        self.limits = Limits(facts.name, facts.max_model_len, facts.vocab_size)
        self.policy = worker.config.kv_load_failure_policy
        self._fallbacks_logged = float("-inf")  # time.monotonic() of the last one logged
        self._fallbacks_unlogged = 0

    def _prompt(self, req: wpb.DecodeRequest) -> list[int]:
        checks.check_id("request_id", req.request_id)
        local = not req.HasField("handle")  # no prefill worker: prefill here
        # n > 1: every choice samples its own token 1 here (`_choices`)
        alone = local or req.sampling.n > 1
        ids = [*req.prompt_token_ids] if alone else [*req.prompt_token_ids, req.first_token_id]
        checks.check_prompt(ids, self.limits, "prompt_token_ids + first_token_id")
        if req.generated_tokens >= len(req.prompt_token_ids):
            raise InvalidRequest(f"generated_tokens: {req.generated_tokens} must be fewer than "
                                 f"the {len(req.prompt_token_ids)} prompt tokens")
        h = req.handle
        if not local and self.worker.identity.role == "prefill":
            raise IncompatiblePair("this is a prefill worker: it receives no KV, so it serves "
                                   "whole requests only (no transfer handle)")
        if not local:
            checks.check_id("handle.transfer_id", h.transfer_id)
            if h.lora_name != req.lora_name:  # KV computed under one adapter, never another
                raise IncompatiblePair(
                    f"lora_name: {req.lora_name or 'the base model'!r}, but the transfer's KV "
                    f"was computed with {h.lora_name or 'the base model'!r}; prefill and "
                    "decode of one request run under the same adapter")
            if not 0 < h.num_tokens <= len(req.prompt_token_ids):
                raise InvalidRequest(
                    f"handle.num_tokens: {h.num_tokens} must be in 1..{len(req.prompt_token_ids)}"
                    " (the prompt's tokens)")
            problem = tp_problem(int(h.prefill_tp) or 1, self.worker.fingerprint.num_kv_heads)
            if problem:
                raise InvalidRequest(f"handle.prefill_tp: {problem}")
            block_size = self.worker.fingerprint.block_size
            if h.first_block * block_size >= h.num_tokens:
                raise InvalidRequest(
                    f"handle.first_block: {h.first_block} blocks of {block_size} tokens leave "
                    f"none of the transfer's {h.num_tokens} tokens")
        check_fault(req.fault, self.worker.config.allow_fault_injection)
        return ids

    def _kv_params(self, req: wpb.DecodeRequest) -> dict[str, Any]:
        """How this request's prompt KV arrives: by the transfer its handle names, or
        (no handle; a stale one under the recompute policy) computed here."""
        if not req.HasField("handle"):
            return {}
        h = req.handle
        epoch = self.worker.identity.epoch
        if h.decode_epoch == epoch:
            return {"kv_transfer_params": RecvParams(
                h.transfer_id, h.num_tokens, req.fault, first_block=h.first_block,
                prefill_tp=int(h.prefill_tp) or 1).to_params()}
        stale = (f"stale transfer handle {h.transfer_id}: its KV was sent to epoch "
                 f"{h.decode_epoch} of this worker, which restarted (epoch {epoch})")
        KV_FAILURES.labels(self.policy).inc()
        if self.policy == "fail":
            raise IncompatiblePair(stale)
        log.warning("%s; recomputing the prompt", stale)
        return {}

    async def Decode(self, req: wpb.DecodeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[pb.GenerateResponse]:
        received_wall, first_step_wall, steps, tokens = time.time(), 0.0, 0, 0
        me = self.worker.identity
        parent = tracing.extract_grpc(context.invocation_metadata())
        span = decode_span(req.request_id, len(req.prompt_token_ids), me.worker_id, me.epoch,
                           parent, local_prefill=not req.HasField("handle"))
        try:
            ids = self._prompt(req)
            sampling, max_tokens = checks.check_sampling(req.sampling, self.limits, len(ids))
            # The answer so far (and token 1, the prefill worker's): an output
            # constraint resumes after it.
            resume = req.generated_tokens + (len(ids) - len(req.prompt_token_ids))
            lora = self.worker.engine.lora_request(req.lora_name)
            extra = self._kv_params(req)
            if sampling.n > 1 and extra:
                stream = self._choices(req.request_id, ids, sampling, max_tokens, extra,
                                       resume, lora)
            else:  # one answer, or vLLM's parallel sampling of a prompt computed here
                stream = self._outputs(req.request_id, ids, vllm_params(
                    sampling, max_tokens, extra_args=extra, resume_tokens=resume), sampling.n,
                    lora)
        except Exception as e:
            span.fail(e, error_type(e))
            span.end()
            raise
        try:
            async for out, deltas in stream:
                steps += 1
                first_step_wall = first_step_wall or time.time()
                for delta in deltas:
                    tokens += len(delta.token_ids)
                    if wire.is_chunk(delta):
                        yield wire.chunk_pb(delta)
                delta = deltas[-1]
                if not delta.finished:
                    continue
                if delta.finish_reason == "error":
                    if sampling.structured is not None:
                        raise Unavailable("the engine failed the request: its KV transfer "
                                          "failed under the 'fail' policy, or its output "
                                          "constraint could not resume; retry the request")
                    raise Unavailable("the prompt's KV transfer failed and the KV load failure "
                                      "policy is 'fail'; retry the request")
                report = self._report(out) if req.HasField("handle") else None
                delta.timings = self._timings(delta, report, req)
                if req.HasField("handle"):
                    slow_leg(req, received_wall, first_step_wall, report)
                if span:
                    load = None if report is None else KVLoad(
                        report, self.worker.config.kv_transport, req.handle.prefill_worker_id,
                        me.worker_id)
                    finish_decode(span, parent, DecodeTally(
                        received_wall, first_step_wall, steps, tokens, delta.finish_reason),
                        delta.timings, load)
                yield wire.final_pb(delta)
                return
            raise Aborted("the request was aborted by the server")
        except Exception as e:
            span.fail(e, error_type(e))
            raise
        finally:
            span.end()
            await stream.aclose()  # type: ignore[attr-defined]

    async def _outputs(self, request_id: str, ids: list[int], params: Any, n: int,
                       lora: Any = None) -> AsyncIterator[tuple[Any, list[Delta]]]:
        """The engine's outputs for one request, each with its deltas."""
        choices = Choices() if n > 1 else None
        async for out in self.worker.engine.generate(ids, params, request_id, lora):
            yield out, choices.deltas(out) if choices else [delta_of_output(out)]

    async def _choices(self, request_id: str, ids: list[int], sampling: Sampling,
                       max_tokens: int, extra: dict[str, Any], resume: int,
                       lora: Any = None) -> AsyncIterator[tuple[Any, list[Delta]]]:
        """n > 1 answers from one shipped prompt KV: choice 0 loads the transfer (vLLM's
        own parallel sampling would have every choice claim it); the others start once it
        is in, and take the prompt's full blocks from this engine's prefix cache. Choice i
        samples every token here with seed + i, as vLLM's parallel sampling does. The
        last item is choice 0's final output with the request's end."""
        engine = self.worker.engine
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def run(i: int) -> None:
            seed = None if sampling.seed is None else sampling.seed + i
            params = vllm_params(replace(sampling, n=1, seed=seed), max_tokens,
                                 extra_args=extra if i == 0 else None, resume_tokens=resume)
            try:
                async for out in engine.generate(ids, params, f"{i}_{request_id}", lora):
                    await queue.put((i, out))
            except Exception as e:
                await queue.put((i, e))
                return
            await queue.put((i, None))

        tasks = [asyncio.create_task(run(0))]

        def start_the_others() -> None:
            if len(tasks) == 1:
                tasks.extend(asyncio.create_task(run(i)) for i in range(1, sampling.n))

        try:
            ended, last0 = 0, None
            finish: tuple[str | None, str | int | None] = (None, None)
            while ended < sampling.n:
                i, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                start_the_others()  # choice 0 has an output (or ended): its KV is in
                if item is None:
                    ended += 1
                    continue
                delta = delta_of_output(item)
                delta.index = i
                if delta.finished:
                    delta.choice_finish_reason, delta.choice_stop_reason = (
                        delta.finish_reason, delta.stop_reason)
                    delta.finished, delta.finish_reason, delta.stop_reason = False, None, None
                    if i == 0:
                        last0, finish = item, (delta.choice_finish_reason,
                                               delta.choice_stop_reason)
                yield item, [delta]
            if last0 is None:
                raise Aborted("the request was aborted by the server")
            yield last0, [end_delta(last0, *finish)]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    def _report(out: Any) -> LoadReport | None:
        """The connector's report on this request's KV load (None: nothing loaded)."""
        return LoadReport.of_output(getattr(out, "kv_transfer_params", None))

    def _timings(self, delta: Delta, report: LoadReport | None, req: wpb.DecodeRequest
                 ) -> Timings:
        t = delta.timings
        if not req.HasField("handle"):  # prefilled here: the phases as colocated reports them
            timings = Timings(queue_s=t.queue_s, prefill_s=t.prefill_s, decode_s=t.decode_s)
        else:
            timings = Timings(decode_queue_s=t.queue_s, decode_s=t.prefill_s + t.decode_s)
        if report is None:
            return timings
        if not report.ok and not report.recomputed:  # recomputed or failed, by policy
            KV_FAILURES.labels(self.policy).inc()
            return timings
        timings.kv_reused_tokens = report.reused_tokens
        KV_REUSED_TOKENS.inc(report.reused_tokens)
        if report.recomputed:  # the transfer was dropped unread; the prompt ran here
            self._fell_back(report)
            return timings
        if not report.nbytes:  # the engine held the whole prompt: the transfer went unread
            return timings
        h = req.handle
        timings.kv_prompt_bytes = report.prompt_nbytes
        KV_PROMPT_BYTES.inc(report.prompt_nbytes)
        first, last = report.first_byte_wall, report.last_byte_wall
        timings.kv_transfer_s = max(0.0, last - first)
        timings.kv_transfer_bytes = report.nbytes
        timings.kv_transfer_hidden_s = overlap(first, last, h.prefill_start_wall,
                                               h.prefill_done_wall)
        KV_BYTES.inc(report.nbytes)
        KV_SECONDS.observe(timings.kv_transfer_s)
        return timings

    def _fell_back(self, report: LoadReport) -> None:
        """Count a request that computed its prompt here although KV was shipped for it,
        and log it now and then: each one costs a prefill on the decode pool, and many
        mean the router believes in cached prefixes this worker evicts."""
        KV_REUSE_FALLBACKS.labels(report.recomputed).inc()
        self._fallbacks_unlogged += 1
        now = time.monotonic()
        if now - self._fallbacks_logged >= FALLBACK_LOG_EVERY_S:
            log.warning(
                "%d request(s) computed their prompt here instead of loading the KV shipped "
                "for them (latest: %s, %s; it held %d prompt tokens); counted in "
                "pdserve_kv_reuse_fallbacks_total", self._fallbacks_unlogged,
                report.transfer_id, report.recomputed, report.reused_tokens)
            self._fallbacks_logged, self._fallbacks_unlogged = now, 0

    async def Release(self, req: wpb.ReleaseRequest, context: grpc.aio.ServicerContext
                      ) -> wpb.ReleaseResponse:
        checks.check_id("transfer_id", req.transfer_id)
        if self.worker.identity.role == "decode":  # a prefill worker receives no KV
            await worker_ext.release(self.worker.engine.llm, req.transfer_id)
        RELEASED.inc()
        return wpb.ReleaseResponse()

    async def GetWorkerInfo(self, req: wpb.GetWorkerInfoRequest,
                            context: grpc.aio.ServicerContext) -> wpb.WorkerInfo:
        return self.worker.info()

    async def WatchKVEvents(self, req: wpb.WatchKVEventsRequest,
                            context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[wpb.WatchKVEventsResponse]:
        async for batch in kv_events.watch(self.worker.kv_events, context):
            yield batch

    async def LoadLoraAdapter(self, req: pb.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext
                              ) -> pb.LoadLoraAdapterResponse:
        loaded = await self.worker.engine.add_adapter(req.lora_name, req.lora_path)
        return pb.LoadLoraAdapterResponse(
            message=f"LoRA adapter {req.lora_name!r} "
            f"{'loaded' if loaded else 'was already loaded'} on {self.worker.identity.worker_id}")

    async def UnloadLoraAdapter(self, req: pb.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext
                                ) -> pb.UnloadLoraAdapterResponse:
        await self.worker.engine.remove_adapter(req.lora_name)
        return pb.UnloadLoraAdapterResponse(
            message=f"LoRA adapter {req.lora_name!r} unloaded on "
            f"{self.worker.identity.worker_id}")


def slow_leg(req: wpb.DecodeRequest, received_wall: float, first_step_wall: float,
             report: LoadReport | None) -> None:
    """Log a transferred request whose decode leg started late, with its waits measured
    from the end of its prefill (wall clocks: the prefill worker's and this one's)."""
    done = req.handle.prefill_done_wall
    if not done or first_step_wall - done < SLOW_LEG_LOG_S:
        return
    kv = "no KV loaded"
    if report is not None and report.first_byte_wall:
        kv = (f"KV first byte {report.first_byte_wall - done:+.2f} s, last byte "
              f"{report.last_byte_wall - done:+.2f} s")
    log.warning("request %s: first decode step %.2f s after its prefill finished: the "
                "Decode call arrived at %+.2f s, %s, first step %.2f s after the call "
                "(transfer %s from %s)", req.request_id, first_step_wall - done,
                received_wall - done, kv, first_step_wall - received_wall,
                req.handle.transfer_id, req.handle.prefill_worker_id)


def decode_service(worker: Worker) -> Service:
    servicer = DecodeServicer(worker)
    return Service(SERVICE, lambda server: wpb_grpc.add_DecodeServiceServicer_to_server(
        servicer, server))
