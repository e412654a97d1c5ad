"""What the served model allows (`Limits`) and the checks of a generation request's
tokens and sampling against it: pure functions, no engine, no sockets, shared by every
process that takes a request (the public API's validation, the workers' checks).

Every rejection names the field and says what is allowed, so a caller can fix its
request without reading the server's code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.v1 import generate_pb2 as pb
from services.errors import InvalidRequest
from services.messages import Sampling, Structured

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # a bias is in [-100, 100], as OpenAI's API documents it
MAX_LOGIT_BIAS_TOKENS = 1024  # entries of one request's logit_bias
MAX_TEMPERATURE = 2.0  # OpenAI's and vLLM's servers' bound
MAX_SEED = 2**63 - 1  # vLLM seeds a torch generator: a signed 64-bit integer
# Output constraints: the text of a schema, regex or grammar, and the choices. A
# grammar is compiled once per request on each engine that runs it.
MAX_STRUCTURED_CHARS = 65536
MAX_CHOICES = 1024
MAX_N = 16  # answers per request: each is a running sequence on the (decode) engine
GREEDY_BELOW = 1e-5  # vLLM samples greedily below this temperature


def invalid(message: str) -> InvalidRequest:
    return InvalidRequest(message)


@dataclass(frozen=True, slots=True)
class Limits:
    """What the served model allows."""

    served_model: str
    max_model_len: int
    vocab_size: int


def check_token_ids(ids: tuple[int, ...] | list[int], limits: Limits, field: str) -> None:
    if not ids:
        raise invalid(f"{field}: the prompt is empty")
    for i, t in enumerate(ids):
        if not 0 <= t < limits.vocab_size:
            raise invalid(
                f"{field}[{i}]: {t} is outside the vocabulary (0..{limits.vocab_size - 1})"
            )


def _finite(name: str, value: float, low: float, high: float, what: str) -> float:
    if not (math.isfinite(value) and low <= value <= high):
        raise invalid(f"sampling.{name}: {value} must be {what}")
    return value


def check_sampling(s: pb.SamplingParams, limits: Limits) -> Sampling:
    """Check every sampling field against what vLLM accepts (so that the engine never
    refuses what passed here); the validated settings. max_tokens is checked against
    the prompt by `resolve_max_tokens`."""
    temperature = top_p = min_p = presence = frequency = repetition = None
    top_k = seed = logprobs = None
    if s.HasField("temperature"):
        temperature = _finite("temperature", s.temperature, 0.0, MAX_TEMPERATURE,
                              f"in [0, {MAX_TEMPERATURE:g}] (0 = greedy)")
    if s.HasField("top_p"):
        top_p = _finite("top_p", s.top_p, 0.0, 1.0, "in (0, 1]")
        if top_p == 0.0:
            raise invalid(f"sampling.top_p: {s.top_p} must be in (0, 1]")
    if s.HasField("top_k"):
        if s.top_k < -1:
            raise invalid(f"sampling.top_k: {s.top_k} must be -1 or 0 (off), or >= 1")
        top_k = 0 if s.top_k == -1 else s.top_k
    if s.HasField("min_p"):
        min_p = _finite("min_p", s.min_p, 0.0, 1.0, "in [0, 1]")
    if s.HasField("presence_penalty"):
        presence = _finite("presence_penalty", s.presence_penalty, -2.0, 2.0, "in [-2, 2]")
    if s.HasField("frequency_penalty"):
        frequency = _finite("frequency_penalty", s.frequency_penalty, -2.0, 2.0, "in [-2, 2]")
    if s.HasField("repetition_penalty"):
        repetition = _finite("repetition_penalty", s.repetition_penalty, 0.0, math.inf,
                             "finite and > 0")
        if repetition == 0.0:
            raise invalid(f"sampling.repetition_penalty: {s.repetition_penalty} must be "
                          "finite and > 0")
    if s.min_tokens < 0:
        raise invalid(f"sampling.min_tokens: {s.min_tokens} must be >= 0")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise invalid(f"sampling.stop: {len(s.stop)} stop strings; at most {MAX_STOP_STRINGS}")
    for i, stop in enumerate(s.stop):
        if not stop or len(stop) > MAX_STOP_STRING_CHARS:
            raise invalid(f"sampling.stop[{i}]: must have 1..{MAX_STOP_STRING_CHARS} characters")
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"sampling.stop_token_ids: at most {MAX_STOP_TOKEN_IDS}")
    for i, t in enumerate(s.stop_token_ids):
        if not 0 <= t < limits.vocab_size:
            raise invalid(f"sampling.stop_token_ids[{i}]: {t} is outside the vocabulary")
    if s.HasField("seed"):
        if s.seed > MAX_SEED:
            raise invalid(f"sampling.seed: {s.seed} must be at most {MAX_SEED}")
        seed = s.seed
    if s.HasField("logprobs"):
        if not 0 <= s.logprobs <= MAX_LOGPROBS:
            raise invalid(f"sampling.logprobs: {s.logprobs} must be in [0, {MAX_LOGPROBS}]")
        logprobs = s.logprobs
    structured = check_structured_form(s.structured) if s.HasField("structured") else None
    if len(s.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
        raise invalid(f"sampling.logit_bias: {len(s.logit_bias)} tokens; at most "
                      f"{MAX_LOGIT_BIAS_TOKENS}")
    for token, bias in s.logit_bias.items():
        if not 0 <= token < limits.vocab_size:
            raise invalid(f"sampling.logit_bias: token {token} is outside the vocabulary "
                          f"(0..{limits.vocab_size - 1})")
        if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise invalid(f"sampling.logit_bias: the bias of token {token} ({bias}) must be in "
                          f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
    n = 1
    if s.HasField("n"):
        if not 1 <= s.n <= MAX_N:
            raise invalid(f"sampling.n: {s.n} must be in [1, {MAX_N}]")
        n = s.n
        if n > 1 and temperature is not None and temperature < GREEDY_BELOW:
            raise invalid(f"sampling.n: {n} answers need sampling (temperature > 0); greedy "
                          "sampling has one answer (vLLM refuses it too)")
        if seed is not None and seed + n - 1 > MAX_SEED:
            raise invalid(f"sampling.seed: {seed} must be at most {MAX_SEED - n + 1} with "
                          f"n={n} (choice i samples with seed + i)")
    return Sampling(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        presence_penalty=presence, frequency_penalty=frequency,
        repetition_penalty=repetition,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        min_tokens=s.min_tokens, stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos, seed=seed, logprobs=logprobs, structured=structured, n=n,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        include_stop_str_in_output=s.include_stop_str_in_output)


def check_structured_form(st: pb.StructuredOutput) -> Structured | None:
    """The constraint's form and size (what it means is checked by compiling it,
    `services/engine/structured.py`); None when no kind is set."""
    kind = st.WhichOneof("kind")
    name = f"sampling.structured.{kind}"
    if kind is None:
        return None
    if kind == "json_object":
        if not st.json_object:
            raise invalid(f"{name}: must be true when set; leave `structured` unset for "
                          "free text")
        return Structured("json_object")
    if kind == "choice":
        choices = tuple(st.choice.choices)
        if not choices:
            raise invalid(f"{name}.choices: at least one choice is needed")
        if len(choices) > MAX_CHOICES:
            raise invalid(f"{name}.choices: {len(choices)} choices; at most {MAX_CHOICES}")
        for i, c in enumerate(choices):
            if not c:
                raise invalid(f"{name}.choices[{i}]: empty; every choice needs a character")
        if sum(len(c) for c in choices) > MAX_STRUCTURED_CHARS:
            raise invalid(f"{name}.choices: more than {MAX_STRUCTURED_CHARS} characters in all")
        return Structured("choice", choices)
    text: str = getattr(st, kind)
    if kind != "regex" and not text.strip():
        raise invalid(f"{name}: empty")
    if len(text) > MAX_STRUCTURED_CHARS:
        raise invalid(f"{name}: {len(text)} characters; at most {MAX_STRUCTURED_CHARS}")
    return Structured("json" if kind == "json_schema" else kind, text)


def resolve_max_tokens(s: Sampling, prompt_len: int, limits: Limits) -> int:
    """Check the prompt against the context and pick max_tokens (default: the rest of
    the context, as vLLM does)."""
    room = limits.max_model_len - prompt_len
    if room < 1:
        raise invalid(
            f"prompt: {prompt_len} tokens leave no room for output in the context of "
            f"{limits.max_model_len} tokens; shorten the prompt"
        )
    if s.max_tokens is None:
        if s.min_tokens > room:
            raise invalid(
                f"sampling.min_tokens: {s.min_tokens} is more than the {room} tokens the "
                f"context of {limits.max_model_len} leaves after a {prompt_len}-token prompt")
        return room
    if s.max_tokens <= 0:
        raise invalid(f"sampling.max_tokens: {s.max_tokens} must be >= 1")
    if s.max_tokens > room:
        raise invalid(
            f"sampling.max_tokens: {s.max_tokens} is beyond the context: the prompt has "
            f"{prompt_len} tokens and the context {limits.max_model_len}, so at most {room}"
        )
    if s.min_tokens > s.max_tokens:
        raise invalid(
            f"sampling.min_tokens: {s.min_tokens} is more than max_tokens {s.max_tokens}"
        )
    return s.max_tokens
