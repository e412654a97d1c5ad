"""Settings files (`--config FILE.yaml`): precedence, refusals with the key's path,
`pdserve config show`, and `--help` grouped by section."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from services.cli import build_parser, main
from services.config_file import ConfigFileError, load_config, mask, parse_config
from services.config_sections import SECTIONS, section_models, section_of
from services.engine.config import EngineConfig
from services.router.config import RouterConfig
from services.settings import from_arguments
from services.worker.config import WorkerConfig


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "stack.yaml"
    path.write_text(text)
    return str(path)


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


@pytest.fixture(autouse=True)
def no_pdserve_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in [k for k in os.environ if k.startswith("PDSERVE_")]:
        monkeypatch.delenv(key)


def test_flag_beats_env_beats_file_beats_default(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    config = write(tmp_path, "engine:\n  max_model_len: 1024\n  kv_cache_gib: 2\n"
                             "  max_num_seqs: 8\n  seed: 5\n")
    monkeypatch.setenv("PDSERVE_KV_CACHE_GIB", "3")
    monkeypatch.setenv("PDSERVE_MAX_NUM_SEQS", "16")
    args = parse(["prefill", "--config", config, "--max-num-seqs", "32"])
    engine = from_arguments(EngineConfig, args)
    assert engine.max_num_seqs == 32  # flag > env > file
    assert engine.kv_cache_gib == 3  # env > file
    assert engine.max_model_len == 1024 and engine.seed == 5  # file > default
    assert engine.block_size == EngineConfig.model_fields["block_size"].default
    # The file's keys count as chosen, as the environment's do (`up`'s step bounds).
    assert {"max_model_len", "seed"} <= engine.model_fields_set


def test_each_section_reaches_only_its_model(tmp_path: Path) -> None:
    config = write(tmp_path, "router:\n  redis_url: redis://r:6379/0\n"
                             "worker:\n  redis_url: redis://w:6379/0\n")
    args = parse(["router", "--config", config])
    assert from_arguments(RouterConfig, args).redis_url == "redis://r:6379/0"
    assert from_arguments(WorkerConfig, args).redis_url == "redis://w:6379/0"


def test_an_unknown_key_is_refused_with_its_path(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = write(tmp_path, "engine:\n  kv_cache_gb: 2\n")
    with pytest.raises(ConfigFileError, match=r"stack\.yaml: engine\.kv_cache_gb is not a "
                       r"setting \(did you mean kv_cache_gib\?\)"):
        load_config(config)
    with pytest.raises(SystemExit) as exit_:
        parse(["up", "--config", config])
    assert exit_.value.code == 2
    assert "engine.kv_cache_gb is not a setting" in capsys.readouterr().err


def test_an_unknown_section_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ConfigFileError, match=r"x\.yaml: enigne is not a section \(did you "
                       r"mean engine\?\); sections: server, engine"):
        parse_config("enigne:\n  max_model_len: 1024\n", "x.yaml")


@pytest.mark.parametrize(("text", "message"), [
    ("engine:\n  max_model_len: big\n",
     r"engine\.max_model_len: Input should be a valid integer.*\(got 'big'\)"),
    ("engine:\n  max_model_len: 8\n", r"engine\.max_model_len: Input should be greater than "
     r"or equal to 16"),
    ("worker:\n  kv_transport: rdma\n", r"worker\.kv_transport: Input should be 'grpc', "
     r"'torch' or 'nixl'"),
    ("engine: 4096\n", r"engine must be a mapping"),
    ("- engine\n", r"must be a mapping of sections"),
    ("engine: [\n", r"not YAML"),
])
def test_a_wrong_value_is_refused_with_pydantics_message(text: str, message: str) -> None:
    with pytest.raises(ConfigFileError, match=rf"^x\.yaml: {message}"):
        parse_config(text, "x.yaml")


def test_an_empty_file_changes_nothing(tmp_path: Path) -> None:
    args = parse(["decode", "--config", write(tmp_path, "# nothing yet\n")])
    assert from_arguments(EngineConfig, args) == EngineConfig()


def test_config_show_prints_a_file_that_loads_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    config = write(tmp_path, "engine:\n  max_model_len: 1024\nrouter:\n  policy: round_robin\n"
                             "launcher:\n  prefill: 2\n")
    monkeypatch.setenv("PDSERVE_REDIS_URL", "redis://:hunter2@redis.example:6379/0")
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "a-cluster-secret-of-some-length")
    assert main(["config", "show", "--for", "up", "--config", config, "--decode", "3",
                 "--api-keys-file", "/etc/pdserve/keys"]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out and "a-cluster-secret" not in out
    shown = parse_config(out, "shown.yaml")  # loads back as a settings file
    by_section = {section_of(model): values for model, values in shown.values.items()}
    assert by_section["engine"]["max_model_len"] == 1024  # file
    assert by_section["router"]["policy"] == "round_robin"
    assert by_section["launcher"]["prefill"] == 2
    assert by_section["launcher"]["decode"] == 3  # flag
    assert by_section["router"]["redis_url"] == "redis://:***@redis.example:6379/0"
    assert by_section["cluster"]["cluster_secret"] == "***"
    assert by_section["server"]["api_keys_file"] == "/etc/pdserve/keys"  # a path: shown
    # `up` takes no worker_id or redis_url for its workers: not shown.
    assert "worker_id" not in by_section["worker"]
    assert set(by_section) == {"launcher", "router", "engine", "worker", "server", "cluster"}


def test_config_show_for_a_worker_shows_its_sections_only(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--for", "decode", "--kv-port", "14579"]) == 0
    shown = parse_config(capsys.readouterr().out, "shown.yaml")
    assert {section_of(m) for m in shown.values} == {"engine", "server", "worker", "cluster"}
    assert shown.values_for(WorkerConfig)["kv_port"] == 14579


def test_unknown_flags_are_still_refused() -> None:
    with pytest.raises(SystemExit):
        main(["router", "--max-inflght", "3"])


@pytest.mark.parametrize(("name", "value", "shown"), [
    ("redis_url", "redis://:pw@host:6379/0", "redis://:***@host:6379/0"),
    ("redis_url", "rediss://user:pw@host:6380/2", "rediss://user:***@host:6380/2"),
    ("redis_url", "redis://host:6379/0", "redis://host:6379/0"),
    ("otlp_traces_endpoint", "https://u:p@otel:4317", "https://u:***@otel:4317"),
    ("cluster_secret_file", "/run/secrets/cluster", "/run/secrets/cluster"),
    ("api_keys", "a:k1,b:k2", "***"),
    ("port", 50051, 50051),
    ("cluster_secret", "", ""),
])
def test_secrets_are_masked(name: str, value: object, shown: object) -> None:
    assert mask(name, value) == shown


def test_help_groups_flags_by_section_with_advanced_knobs_apart() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    up = sub.choices["up"]
    titles = [g.title for g in up._action_groups]
    assert titles[-1] == "advanced"
    assert {"launcher", "router", "engine", "worker", "server", "cluster"} <= set(titles)
    groups = {g.title: {o for a in g._group_actions for o in a.option_strings}
              for g in up._action_groups}
    assert "--max-model-len" in groups["engine"]
    assert {"--kv-checksum", "--kv-staging-gib", "--stream-silence-s",
            "--actor-probe-timeout-s", "--kv-header-timeout-s"} <= groups["advanced"]
    assert "--kv-checksum" not in groups["worker"]
    text = up.format_help()
    assert "How one vLLM engine is built (settings file section `engine:`)" in text
    assert "file engine.max_model_len" in text


def test_every_section_names_a_settings_model_where_it_lives() -> None:
    models = section_models()
    assert list(models) == list(SECTIONS)
    for section, model in models.items():
        assert issubclass(model, BaseSettings)
        assert f"{model.__module__}:{model.__qualname__}" == SECTIONS[section]
        assert section_of(model) == section
    assert len(set(models.values())) == len(models)
