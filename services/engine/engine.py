"""The vLLM engine, embedded in-process (`AsyncLLM`), shared by every serving role.

vLLM runs its engine core and model worker in child processes of this one; the
settings they read from the environment are set here, before they spawn.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.engine import structured
from services.engine.admission import Admission
from services.engine.config import EngineConfig, cpu_only, parse_cores
from services.engine.lora import (
    AdapterTable,
    BaseModel,
    check_adapter,
    check_name,
    parse_lora_modules,
)
from services.engine.model import resolve_model
from services.errors import EngineDead, InvalidRequest, ModelNotFound
from services.kv.tp_layout import check_model_shape, read_hf_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from vllm import RequestOutput, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

# The warm-up requests' prompt: any few token ids every vocabulary has.
WARM_UP_PROMPT = (1, 2, 3, 4)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What clients may ask about the served model."""

    name: str
    path: Path
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    has_chat_template: bool
    tokenizer_class: str
    dtype: str


def children() -> set[int]:
    import psutil

    return {c.pid for c in psutil.Process().children(recursive=True)}


def renice(pids: set[int], offset: int) -> None:
    """Lower the scheduling priority of `pids` (the engine core and its model workers)
    to `offset` above this process's own niceness.

    On a CPU host the model's compute threads and the serving plane (this worker's RPCs
    and health answers, the router, the KV receiver's control stream) share cores; at
    equal priority a busy engine delays them by whole scheduler slices, which clients see
    as stalls and the router's liveness probe as a hang. A lower priority lets the
    serving plane preempt model compute.
    """
    import psutil

    target = min(19, os.getpriority(os.PRIO_PROCESS, 0) + offset)
    for pid in pids:
        try:
            psutil.Process(pid).nice(target)
        except (psutil.Error, OSError) as e:  # gone already, or not ours to change
            log.debug("could not renice %s: %s", pid, e)


def pin(pids: set[int], cores: set[int]) -> None:
    """Keep every thread of `pids` (the engine core and its model workers) on `cores`,
    leaving threads vLLM bound within them (the model's compute threads) as they are.

    vLLM binds only the model's compute threads; the engine-core process, which
    schedules every step, is left wherever the OS puts it. On a small host shared by two
    engines it can land on the other engine's core, where its work for each step waits
    behind that engine's compute, and the running streams' gaps grow whenever the other
    engine prefills. On its own engine's cores it runs between its own model's steps,
    which wait for it anyway (`pin_scheduler`, on by default).
    """
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue  # gone already
        for tid in tids:
            try:
                if not os.sched_getaffinity(tid) <= cores:
                    os.sched_setaffinity(tid, cores)
            except OSError as e:  # gone, or not ours to change
                log.debug("could not pin thread %s of %s: %s", tid, pid, e)


def in_ray_placement_group() -> bool:
    """This process runs inside a Ray placement group (a `pdserve up` actor's)."""
    try:
        import ray
    except ImportError:  # pragma: no cover - Ray comes with pdserve
        return False
    return bool(ray.is_initialized() and ray.util.get_current_placement_group())


class Engine:
    """One `AsyncLLM` plus the tokenizer and facts about its model."""

    def __init__(self, config: EngineConfig, kv_transfer_config: Any | None = None,
                 kv_events_config: Any | None = None) -> None:
        self.config = config
        self.model_path = resolve_model(config.model, config.resolved_dtype())
        self._kv_transfer_config = kv_transfer_config
        self._kv_events_config = kv_events_config  # vLLM's KVEventsConfig (None: off)
        self._llm: AsyncLLM | None = None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._facts: ModelFacts | None = None
        self.admission = Admission(config.max_queued_requests, config.max_queued_prompt_tokens)
        self.adapters = AdapterTable()
        self._base: BaseModel | None = None  # what adapters are checked against
        self._adapters_lock = asyncio.Lock()

    # -- life cycle -------------------------------------------------------------------
    def engine_args(self) -> Any:
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs

        c = self.config
        kwargs: dict[str, Any] = dict(
            model=str(self.model_path),
            served_model_name=self.served_name,
            dtype=c.resolved_dtype(),
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            enable_prefix_caching=c.enable_prefix_caching,
            enforce_eager=c.enforce_eager,
            seed=c.seed,
            # Per-request timings (RequestOutput.metrics) exist only with stats on.
            disable_log_stats=False,
            kv_transfer_config=self._kv_transfer_config,
            kv_events_config=self._kv_events_config,
            tensor_parallel_size=c.tensor_parallel_size,
        )
        if c.tensor_parallel_size > 1 and cpu_only():
            # One process per rank, each bound to its core group (config.threads_bind).
            kwargs["distributed_executor_backend"] = "mp"
        elif c.tensor_parallel_size > 1 and in_ray_placement_group():
            # `pdserve up`: the actor's placement group holds one GPU bundle per rank
            # (launcher/actor_spec.py); vLLM's Ray executor puts a rank on each.
            kwargs["distributed_executor_backend"] = "ray"
        if self._kv_transfer_config is not None:
            # Lets the worker read its connector's staging level (kv/worker_ext.py).
            from services.kv.worker_ext import EXTENSION

            kwargs["worker_extension_cls"] = EXTENSION
            # A worker continues answers begun elsewhere: output constraints resume.
            kwargs["scheduler_cls"] = structured.SCHEDULER
        # One constraint backend for every engine: what the API compile-checked is what
        # each engine compiles, and prefill and decode split the answer alike.
        kwargs["structured_outputs_config"] = StructuredOutputsConfig(backend=structured.BACKEND)
        spec = c.speculative()
        if spec is not None:
            kwargs["speculative_config"] = spec
        if c.lora_enabled:
            kwargs.update(enable_lora=True, max_lora_rank=c.max_lora_rank,
                          max_loras=c.max_loras)
        if c.block_size:
            kwargs["block_size"] = c.block_size
        if c.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = c.max_num_batched_tokens
        if c.long_prefill_token_threshold:
            kwargs["long_prefill_token_threshold"] = c.long_prefill_token_threshold
        if not cpu_only():
            kwargs["gpu_memory_utilization"] = c.gpu_memory_utilization
        return AsyncEngineArgs(**kwargs)

    def start(self) -> None:
        """Build the engine (tens of seconds on a CPU: spawn, imports, weight load)."""
        from transformers import AutoTokenizer
        from vllm.v1.engine.async_llm import AsyncLLM

        # Refused here, in words, rather than by vLLM after its processes spawned.
        check_model_shape(read_hf_config(self.model_path), self.config.tensor_parallel_size,
                          kv_transfer=self._kv_transfer_config is not None)
        for module in parse_lora_modules(self.config.lora_modules):
            try:
                check_adapter(module.path, self.base_model, self.config.max_lora_rank)
            except InvalidRequest as e:
                raise ValueError(f"--lora {module.name}={module.path}: {e.message}") from None
        cores = parse_cores(self.config.resolved_cores())
        if cpu_only() and len(cores) < self.config.tensor_parallel_size:
            log.warning("%d tensor-parallel ranks on %d core(s): ranks share cores and wait "
                        "for each other at every layer; give the engine at least %d cores "
                        "(--cpu-cores)", self.config.tensor_parallel_size, len(cores),
                        self.config.tensor_parallel_size)
        os.environ.update(self.config.vllm_env())
        self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        log.info("starting vLLM engine for %s", self.model_path)
        before = children()
        self._llm = AsyncLLM.from_engine_args(self.engine_args())
        if cpu_only():  # only the processes vLLM just spawned
            spawned = children() - before
            if self.config.pin_scheduler:
                pin(spawned, cores)
            if self.config.engine_nice:
                renice(spawned, self.config.engine_nice)
        self._facts = self._read_facts()

    async def warm_up(self) -> None:
        """Take the first-use costs a user's first request would otherwise pay, before
        serving: on first use vLLM compiles (torch.compile) the sampler's count of the
        tokens ranked above the chosen one, for logprobs, which takes seconds on a CPU.
        One request alone and two together, as a new batch shape may compile again."""
        from vllm import SamplingParams

        for module in parse_lora_modules(self.config.lora_modules):
            await self.add_adapter(module.name, module.path)
        params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True)

        async def one(i: int) -> None:
            async for _ in self.generate(list(WARM_UP_PROMPT), params, f"warm-up-{i}"):
                pass

        await one(0)
        # Two at once: they share at least one step, a batch of two.
        await asyncio.gather(one(1), one(2))
        log.info("engine warmed up (sampling with logprobs)")

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    # -- facts ------------------------------------------------------------------------
    @property
    def served_name(self) -> str:
        return self.config.served_model_name or self.model_path.name

    @property
    def llm(self) -> AsyncLLM:
        if self._llm is None:
            raise RuntimeError("engine not started")
        return self._llm

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            raise RuntimeError("engine not started")
        return self._tokenizer

    @property
    def facts(self) -> ModelFacts:
        if self._facts is None:
            raise RuntimeError("engine not started")
        return self._facts

    def _read_facts(self) -> ModelFacts:
        tok = self.tokenizer
        model_config = self.llm.model_config
        eos = model_config.hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelFacts(
            name=self.served_name,
            path=self.model_path,
            max_model_len=int(model_config.max_model_len),
            vocab_size=int(model_config.get_vocab_size()),
            eos_token_ids=eos_ids,
            bos_token_id=tok.bos_token_id,
            has_chat_template=bool(getattr(tok, "chat_template", None)),
            tokenizer_class=type(tok).__name__,
            dtype=str(model_config.dtype).removeprefix("torch."),
        )

    # -- LoRA adapters ----------------------------------------------------------------
    @property
    def base_model(self) -> BaseModel:
        if self._base is None:
            self._base = BaseModel.read(self.model_path, self.served_name)
        return self._base

    def adapter_paths(self) -> dict[str, str]:
        """The loaded adapters: name -> folder."""
        return self.adapters.paths()

    async def add_adapter(self, name: str, path: str) -> bool:
        """Load an adapter after checking its folder (`AdapterInvalid` names what is
        wrong: the engine never sees a bad one). True when loaded now; False when this
        name was already loaded from this path; `InvalidRequest` when from another."""
        from vllm.lora.request import LoRARequest

        check_name(name)
        if name == self.served_name:
            raise InvalidRequest(f"lora_name: {name!r} is the base model's name; give the "
                                 "adapter another")
        if not self.config.lora_enabled:
            raise InvalidRequest("lora_name: this server runs without LoRA; restart it with "
                                 "--enable-lora (or name adapters with --lora NAME=PATH)")
        async with self._adapters_lock:
            held = self.adapters.get(name)
            if held is not None:
                if held[1] == path:
                    return False
                raise InvalidRequest(f"lora_name: the LoRA adapter {name!r} is already loaded "
                                     f"(from {held[1]}); unload it first")
            check_adapter(path, self.base_model, self.config.max_lora_rank)
            lora_id = self.adapters.add(name, path)
            try:
                await self.llm.add_lora(LoRARequest(name, lora_id, path))
            except Exception as e:  # what the checks above could not foresee
                self.adapters.remove(name)
                if self.dead:
                    raise EngineDead("the engine of this worker is not running") from e
                raise InvalidRequest(f"lora_path: the engine could not load the adapter: "
                                     f"{e}") from e
        log.info("loaded LoRA adapter %s from %s", name, path)
        return True

    async def remove_adapter(self, name: str) -> None:
        """Unload an adapter (`ModelNotFound` when it is not loaded). Requests running
        under it finish; new ones naming it are refused."""
        async with self._adapters_lock:
            lora_id = self.adapters.remove(name)
            await self.llm.remove_lora(lora_id)
        log.info("unloaded LoRA adapter %s", name)

    def lora_request(self, name: str) -> LoRARequest | None:
        """vLLM's handle of a loaded adapter (None for ""), `ModelNotFound` if unknown."""
        if not name:
            return None
        from vllm.lora.request import LoRARequest

        held = self.adapters.get(name)
        if held is None:
            raise ModelNotFound(f"model: the LoRA adapter {name!r} is not loaded on this "
                                "worker")
        return LoRARequest(name, held[0], held[1])

    # -- requests ---------------------------------------------------------------------
    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs; closing or cancelling the iterator aborts the request.
        vLLM's refusals of a parameter raise `InvalidRequest`; a dead engine raises
        `EngineDead` (and `dead` turns true)."""
        from vllm.exceptions import VLLMValidationError
        from vllm.v1.engine.exceptions import EngineDeadError

        self.admission.enter(len(prompt_token_ids))
        queued = True
        try:
            async for out in self.llm.generate(
                {"prompt_token_ids": prompt_token_ids}, params, request_id,
                lora_request=lora_request,
            ):
                if queued:
                    queued = False
                    self.admission.leave(len(prompt_token_ids))
                yield out
        except (VLLMValidationError, ValueError) as e:  # vLLM's own parameter checks
            raise InvalidRequest(f"the engine refused the request: {e}") from e
        except EngineDeadError as e:
            log.error("the engine died serving %s: %s", request_id, e)
            raise EngineDead("the engine of this worker is not running") from e
        finally:
            if queued:
                self.admission.leave(len(prompt_token_ids))
            # vLLM aborts on cancellation itself; an explicit abort also covers a
            # consumer that simply stops iterating (aclose).
            await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        if self._llm is not None and not self.dead:
            await self._llm.abort(request_id)

    @property
    def dead(self) -> bool:
        """The engine core is gone (crashed or killed): nothing more can be served."""
        return self._llm is not None and bool(getattr(self._llm, "errored", False))

    def num_unfinished(self) -> int:
        return int(self.llm.get_num_unfinished_requests())
