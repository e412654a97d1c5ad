"""The connector's scheduler half (runs in vLLM's engine-core process).

Producer (prefill engine): remembers requests that carry send params; in the step that
completes a prompt it emits a SaveJob with the prompt's blocks, so the worker half ships
each layer as it is computed; when the request finishes it keeps the blocks
(delay_free) until the worker half reports the transfer acknowledged or its lease over.

Consumer (decode engine): claims the prompt's tokens beyond its own prefix-cache hit as
an asynchronous remote load, so vLLM parks the request in WAITING_FOR_REMOTE_KVS; once
blocks are allocated it emits a LoadJob naming the local blocks to fill; the worker half
reports the request finished receiving (or failed: vLLM then recomputes or fails it, by
kv_load_failure_policy).

A transfer may leave out the prompt's first blocks, which the decode engine was believed
to hold (`RecvParams.first_block`; see `reuse`). If its hit falls short of them, the
request claims nothing and vLLM computes the prompt here whatever the failure policy: the
transfer did nothing wrong, and recomputing is always right. Such a request, and one
whose engine already holds its whole prompt, drops its transfer at once and carries a
LoadReport that says so.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from services.kv.metadata import LoadJob, LoadReports, PdserveConnectorMetadata, SaveJob
from services.kv.params import LoadReport, RecvParams, SendParams
from services.kv.reuse import ceil_div, plan_load, shipped_blocks

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def lora_name(request: Any) -> str:
    """The LoRA adapter a vLLM request runs under ("" = the base model)."""
    lora = getattr(request, "lora_request", None)
    return str(lora.lora_name) if lora is not None else ""


class SchedulerSide:
    def __init__(self, block_size: int, is_producer: bool, ranks: int = 1) -> None:
        self.block_size = block_size
        self.is_producer = is_producer
        # The engine's tensor-parallel ranks: each rank's worker half loads its own heads
        # and reports its own LoadReport; a load is over once every rank reported.
        self.ranks = ranks
        self._parts: dict[str, tuple[int, LoadReport]] = {}  # rid -> (ranks in, merged)
        # producer
        self._to_save: dict[str, Request] = {}  # waiting for the step that completes the prompt
        self._saving: set[str] = set()  # a SaveJob was emitted: blocks must be held
        # consumer
        self._offsets: dict[str, int] = {}  # locally computed prefix at claim time
        self._dropped: list[str] = []  # transfer ids no request will load
        self._new_loads: list[LoadJob] = []
        self._loading: set[str] = set()  # LoadJob emitted, not yet finished receiving
        self._cancelled: list[str] = []
        self._reports: dict[str, LoadReport] = {}

    # -- matching and allocation ------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed: int) -> tuple[int, bool]:
        if self.is_producer or request.request_id in self._reports:
            return 0, False  # (also: a second look after the load finished)
        if request.request_id in self._loading:
            return 0, False
        params = RecvParams.of(request.kv_transfer_params)
        if params is None:
            return 0, False
        # Claim exactly what will arrive: never more than the prompt minus the token
        # vLLM must compute itself to sample the next one.
        remote = min(params.num_tokens, request.num_prompt_tokens - 1)
        plan = plan_load(num_computed, remote, params.first_block, self.block_size)
        if plan.drop_transfer:
            # Decided once: a later look (no room this step) finds the report and claims
            # nothing either. The report reaches the request's final output.
            self._dropped.append(params.transfer_id)
            self._reports[request.request_id] = LoadReport(
                request.request_id, params.transfer_id, ok=not plan.recomputed,
                reused_tokens=num_computed, recomputed=plan.recomputed)
            if plan.recomputed:
                log.info("%s: the engine holds %d prompt tokens, the transfer %s starts at "
                         "block %d; computing the prompt here", request.request_id,
                         num_computed, params.transfer_id, params.first_block)
            return 0, False
        self._offsets[request.request_id] = num_computed
        return plan.claim, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        if self.is_producer:
            if SendParams.of(request.kv_transfer_params) is not None:
                self._to_save[rid] = request
            return
        if num_external_tokens == 0 or rid not in self._offsets:
            return  # the second call, after the load: nothing to do
        params = RecvParams.of(request.kv_transfer_params)
        assert params is not None
        offset = self._offsets.pop(rid)
        first = offset // self.block_size
        last = ceil_div(offset + num_external_tokens, self.block_size)
        # The table's first `first` blocks are the engine's own prefix-cache hit: vLLM
        # holds them for this request (raised reference counts) while it waits, so they
        # stay until the blocks behind them are filled.
        block_ids = list(blocks.get_block_ids()[0])
        self._new_loads.append(
            LoadJob(
                req_id=rid,
                transfer_id=params.transfer_id,
                local_block_ids=block_ids[first:last],
                remote_first_block=first,
                fault=params.fault,
                lora=lora_name(request),
                transfer_first_block=params.first_block,
                reused_tokens=offset,
                prefill_tp=params.prefill_tp,
            )
        )
        self._loading.add(rid)

    # -- every step -------------------------------------------------------------------
    def build_connector_meta(self, so: SchedulerOutput) -> PdserveConnectorMetadata:
        meta = PdserveConnectorMetadata()
        if self.is_producer:
            meta.saves = self._completing_prompts(so)
        else:
            meta.loads, self._new_loads = self._new_loads, []
            meta.cancelled_loads, self._cancelled = self._cancelled, []
            meta.dropped_transfers, self._dropped = self._dropped, []
        return meta

    def _completing_prompts(self, so: SchedulerOutput) -> list[SaveJob]:
        jobs = []
        for rid, request in list(self._to_save.items()):
            scheduled = so.num_scheduled_tokens.get(rid, 0)
            # num_computed_tokens is advanced only after this call: this step finishes
            # the prompt when what was computed plus what is scheduled covers it.
            if not scheduled or request.num_computed_tokens + scheduled < request.num_prompt_tokens:
                continue
            state = so.kv_connector_block_state
            table = state.get_block_ids(rid) if state is not None else None
            del self._to_save[rid]
            if not table:
                log.error("no block table for %s; its KV cannot be shipped", rid)
                continue
            params = SendParams.of(request.kv_transfer_params)
            assert params is not None
            n = request.num_prompt_tokens
            first = params.first_block
            if not 0 <= first < ceil_div(n, self.block_size):
                # The worker service checks the hint; should one slip through, ship every
                # block: the decode side then refuses the transfer (it expects another
                # first block) and computes the prompt, rather than waiting for KV.
                log.error("%s: first block %d outside the prompt's %d tokens; shipping "
                          "every block", rid, first, n)
                first = 0
            # The last, partial block travels whole: the decode side writes token 1 at
            # offset n % block_size, and attention never reads past the sequence.
            shipped = shipped_blocks(n, self.block_size, first)
            jobs.append(
                SaveJob(
                    req_id=rid,
                    transfer_id=params.transfer_id,
                    kv_address=params.kv_address,
                    kv_transport=params.kv_transport,
                    decode_epoch=params.decode_epoch,
                    decode_fingerprint=params.decode_fingerprint,
                    block_ids=list(table[0][shipped.start : shipped.stop]),
                    num_tokens=n,
                    fault=params.fault,
                    same_host=params.same_host,
                    lora=lora_name(request),
                    first_block=first,
                    kv_addresses=params.rank_addresses,
                )
            )
            self._saving.add(rid)
        return jobs

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(meta, LoadReports):
            for report in meta.reports:
                rid = report.req_id
                if rid not in self._loading:  # aborted, nobody will ask
                    continue
                count, merged = self._parts.pop(rid, (0, None))
                merged = report if merged is None else merged.merged(report)
                if count + 1 < self.ranks:
                    self._parts[rid] = (count + 1, merged)
                else:
                    self._reports[rid] = merged
                    self._loading.discard(rid)
        for rid in output.finished_sending or ():
            self._saving.discard(rid)

    # -- the end of a request ---------------------------------------------------------
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        if self.is_producer:
            self._to_save.pop(rid, None)
            # Hold the blocks while their transfer is in flight; the worker half
            # reports this id once the receiver acknowledged or the lease ran out.
            return rid in self._saving, None
        self._offsets.pop(rid, None)
        self._parts.pop(rid, None)
        if rid in self._loading:
            # Aborted while waiting for its KV: vLLM keeps the blocks until the worker
            # half reports the id as received; tell it to stop waiting now.
            self._cancelled.append(rid)
            self._loading.discard(rid)
        report = self._reports.pop(rid, None)
        return False, (report.to_output() if report else None)
