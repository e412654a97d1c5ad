"""Settings: one model gives env names, CLI flags and defaults."""

from __future__ import annotations

import argparse

import pytest

from services.engine.config import EngineConfig, cpu_only
from services.server.settings import ServerConfig
from services.settings import add_arguments, env_name, from_arguments


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    add_arguments(parser, ServerConfig)
    return parser.parse_args(argv)


def test_flags_override_env_override_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_KV_CACHE_GIB", "3")
    monkeypatch.setenv("PDSERVE_MAX_MODEL_LEN", "1024")
    cfg = from_arguments(EngineConfig, parse(["--max-model-len", "512", "--no-enforce-eager"]))
    assert cfg.kv_cache_gib == 3  # env
    assert cfg.max_model_len == 512  # flag beats env
    assert cfg.enforce_eager is False
    assert cfg.max_num_seqs == EngineConfig.model_fields["max_num_seqs"].default


def test_every_field_has_flag_env_and_help() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    help_text = parser.format_help()
    for name, field in EngineConfig.model_fields.items():
        assert field.description, name
        assert "--" + name.replace("_", "-") in help_text
        assert env_name(EngineConfig, name) == "PDSERVE_" + name.upper()


def test_invalid_values_are_refused() -> None:
    with pytest.raises(ValueError):
        EngineConfig(kv_cache_gib=0)
    with pytest.raises(ValueError, match="integer"):
        EngineConfig(kv_cache_gib=0.5)  # vLLM takes whole GiB and would not start
    with pytest.raises(ValueError):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=8)
    with pytest.raises(SystemExit):
        parse(["--dtype", "int3"])


def test_chunking_settings_reach_vllm() -> None:
    from services.engine.engine import Engine

    args = Engine(EngineConfig(max_num_batched_tokens=512,
                               long_prefill_token_threshold=256)).engine_args()
    assert (args.max_num_batched_tokens, args.long_prefill_token_threshold) == (512, 256)
    default = Engine(EngineConfig()).engine_args()
    assert default.long_prefill_token_threshold == 0  # vLLM's own default
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=1024, long_prefill_token_threshold=2048)


def test_cpu_env_pins_explicit_cores() -> None:
    env = EngineConfig(cpu_cores="1", kv_cache_gib=3).vllm_env()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "0"  # no cache growing with step sizes
    assert EngineConfig(onednn_primitive_cache=64).vllm_env()[
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"
    assert EngineConfig().resolved_cores()  # never vLLM's "auto"


def test_engine_allocator_goes_in_front_of_ld_preload(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pure logic: where tcmalloc is found is FAKED here (the engine tests use the real one).
    from services.engine import config

    monkeypatch.setattr(config, "find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    assert config.preload_allocator("auto", "") == "libtcmalloc_minimal.so.4"
    assert config.preload_allocator("tcmalloc", "libgomp.so") == (
        "libtcmalloc_minimal.so.4:libgomp.so")
    assert config.preload_allocator("auto", "/x/libtcmalloc.so") == "/x/libtcmalloc.so"
    assert config.preload_allocator("system", "libgomp.so") == "libgomp.so"
    monkeypatch.setattr(config, "find_tcmalloc", lambda: None)
    assert config.preload_allocator("auto", "libgomp.so") == "libgomp.so"  # with a warning
    with pytest.raises(RuntimeError, match="libtcmalloc-minimal4"):
        config.preload_allocator("tcmalloc", "")


def test_up_bounds_cpu_engine_steps_unless_the_operator_chose(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from services.cli import build_parser
    from services.engine.config import CPU_STEP_BOUNDS, with_step_bounds
    from services.launcher.settings import stack_from_args

    def engine(*flags: str) -> EngineConfig:
        return stack_from_args(build_parser().parse_args(["up", *flags])).engine

    if cpu_only():
        bounded = engine()
        assert (bounded.max_num_batched_tokens, bounded.long_prefill_token_threshold) == (
            512, 256)
        chosen = engine("--max-num-batched-tokens", "0")  # 0: vLLM's default, as asked
        assert (chosen.max_num_batched_tokens, chosen.long_prefill_token_threshold) == (0, 256)
    gpu = with_step_bounds(EngineConfig(), cpu=False)
    assert gpu.max_num_batched_tokens == 0 and gpu.long_prefill_token_threshold == 0
    # Bounds that would contradict other settings are left out, never made invalid.
    wide = with_step_bounds(EngineConfig(max_num_seqs=1024), cpu=True)
    assert wide.max_num_batched_tokens == 0
    assert wide.long_prefill_token_threshold == CPU_STEP_BOUNDS["long_prefill_token_threshold"]
    short = with_step_bounds(EngineConfig(max_model_len=128), cpu=True)
    assert (short.max_num_batched_tokens, short.long_prefill_token_threshold) == (512, 0)
    if cpu_only():
        monkeypatch.setenv("PDSERVE_LONG_PREFILL_TOKEN_THRESHOLD", "0")
        assert engine().long_prefill_token_threshold == 0  # the environment chooses too


def test_core_lists_parse_and_a_bad_one_says_what_is_expected() -> None:
    from services.engine.config import EngineConfig, parse_cores

    assert parse_cores("0") == {0}
    assert parse_cores("0-3") == {0, 1, 2, 3}
    assert parse_cores("0,2,4-5") == {0, 2, 4, 5}
    with pytest.raises(ValueError, match="not a core list such as '0', '0-3'"):
        EngineConfig(cpu_cores="first")
