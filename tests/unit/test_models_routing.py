"""Several models in one stack, as pure logic: which model a request's `model` names, the
router's pair choice among one model's workers (the router code is real; the workers are
FAKE records in a fixed view, never dialled), and how `pdserve up` is told its models
(flags, settings file) and makes each model's actors. The stack itself:
tests/integration/test_up_models.py."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest

from services.api.models import ServedModel, resolve
from services.cli import build_parser
from services.config_file import parse_config, show
from services.engine.config import EngineConfig
from services.engine.engine import ModelFacts
from services.errors import ModelNotFound, Unavailable
from services.launcher.actor_spec import ActorSpecs, RouterArgs, WorkerArgs
from services.launcher.models import (
    ModelPool,
    ModelsRefused,
    Pool,
    check_models,
    extra_pools,
)
from services.launcher.settings import LauncherConfig, Stack
from services.observability.top import COLUMNS, cells
from services.registry.records import WorkerRecord
from services.router.config import RouterConfig, model_folders
from services.router.events import request_events
from services.router.router import RouterBackend
from services.router.view import FixedView
from services.server.settings import ServerConfig
from services.settings import CONFIG_DEST, add_arguments, from_arguments
from services.worker.config import WorkerConfig
from tests.unit.test_pair_run import FakeTokenizer, record, request
from tests.unit.test_top_format import row


# -- which model a request names -----------------------------------------------------------
def served(name: str, adapters: dict[str, str] | None = None) -> ServedModel:
    facts = ModelFacts(name=name, path=Path("/m") / name, max_model_len=64, vocab_size=100,
                       eos_token_ids=(2,), bos_token_id=None, has_chat_template=False,
                       tokenizer_class="Fake", dtype="float32")
    return ServedModel(facts, FakeTokenizer(), adapters or {})  # type: ignore[arg-type]


def test_a_request_names_a_base_model_an_adapter_of_one_or_the_default() -> None:
    models = [served("smol", {"sql": "/a/sql"}), served("tiny", {"poet": "/a/poet"})]
    assert (resolve(models, "").name, resolve(models, "").lora) == ("smol", "")
    assert resolve(models, "tiny").model.name == "tiny"
    poet = resolve(models, "poet")
    assert (poet.model.name, poet.lora, poet.name) == ("tiny", "poet", "poet")
    with pytest.raises(ModelNotFound) as err:
        resolve(models, "gpt-4")
    assert err.value.message == ("model: 'gpt-4' is not served here; this server serves "
                                 "'smol', 'tiny', 'sql', 'poet' (or leave `model` empty "
                                 "for 'smol')")


# -- the router's pair choice ----------------------------------------------------------------
def worker(worker_id: str, role: str, model: str) -> WorkerRecord:
    # One fingerprint for every worker: the models are kept apart by the router's filter,
    # not by their KV layouts happening to differ.
    return replace(record(worker_id, role, "127.0.0.1:1"), model=model)


def two_models(*records: WorkerRecord) -> RouterBackend:
    view = FixedView(list(records) or [
        worker("smol-p", "prefill", "smol"), worker("smol-d", "decode", "smol"),
        worker("tiny-p", "prefill", "tiny"), worker("tiny-d", "decode", "tiny"),
        worker("other-d", "decode", "other")])
    tok = FakeTokenizer()
    return RouterBackend(RouterConfig(), view, tok, "",  # type: ignore[arg-type]
                         models=[("smol", tok, "/m/smol"), ("tiny", tok, "/m/tiny")])


async def choose(backend: RouterBackend, model: str) -> tuple[str | None, str]:
    req = replace(request(), model=model)
    choice = await backend._choose(req, [], request_events(req, model))
    return (choice.prefill.worker_id if choice.prefill else None), choice.decode.worker_id


async def test_pairs_are_chosen_among_the_named_models_workers_only() -> None:
    backend = two_models()
    await backend.refresh()
    for _ in range(5):
        assert await choose(backend, "tiny") == ("tiny-p", "tiny-d")
        assert await choose(backend, "smol") == ("smol-p", "smol-d")
        assert await choose(backend, "") == ("smol-p", "smol-d")  # the default: the first
    assert [m.name for m in backend.served_models()] == ["smol", "tiny"]  # not "other"
    assert backend.facts.name == "smol"


async def test_an_unknown_model_is_not_found_and_an_empty_pool_unavailable() -> None:
    backend = two_models()
    await backend.refresh()
    with pytest.raises(ModelNotFound, match="this router serves 'smol', 'tiny'"):
        await choose(backend, "other")  # registered, but not one this router serves
    backend._suspect("tiny-d")
    # No decode worker of tiny: its prefill worker serves whole requests, never smol's.
    assert await choose(backend, "tiny") == (None, "tiny-p")
    backend._suspect("tiny-p")
    with pytest.raises(Unavailable, match="no worker of model 'tiny'"):
        await choose(backend, "tiny")
    assert await choose(backend, "smol") == ("smol-p", "smol-d")


async def test_adapters_are_listed_under_the_model_whose_workers_hold_them() -> None:
    backend = two_models(
        worker("smol-d", "decode", "smol"),
        replace(worker("tiny-d", "decode", "tiny"), loras=(("poet", "/a/poet"),)))
    await backend.refresh()
    assert {m.name: m.adapters for m in backend.served_models()} == {
        "smol": {}, "tiny": {"poet": "/a/poet"}}
    assert resolve(backend.served_models(), "poet").model.name == "tiny"


async def test_one_model_routers_keep_to_the_model_their_workers_first_told() -> None:
    tok = FakeTokenizer()
    backend = RouterBackend(RouterConfig(), FixedView([  # type: ignore[arg-type]
        worker("a-d", "decode", "smol"), worker("b-d", "decode", "tiny")]), tok, "")
    await backend.refresh()
    assert backend.facts.name == "smol"
    for _ in range(3):
        assert await choose(backend, "") == (None, "a-d")


def test_router_models_are_name_folder_pairs_in_order() -> None:
    assert model_folders(" smol=/m/smol, tiny=/m/tiny ") == [("smol", "/m/smol"),
                                                              ("tiny", "/m/tiny")]
    with pytest.raises(ValueError, match="'tiny' is not NAME=FOLDER"):
        model_folders("smol=/m/smol,tiny")
    with pytest.raises(ValueError, match="given twice"):
        model_folders("a=/x,a=/y")


# -- how `pdserve up` is told its models -------------------------------------------------------
def parsed(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser, LauncherConfig)
    return parser.parse_args(argv)


def test_add_model_is_repeatable_and_checked_as_it_is_parsed(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = parsed(["--add-model", "model=/m/tiny,name=tiny,decode=2",
                   "--add-model", "model=/m/big,tp=2,max_model_len=4096"])
    models = from_arguments(LauncherConfig, args).models
    assert [(m.model, m.served_name, m.prefill, m.decode, m.tp, m.max_model_len)
            for m in models] == [("/m/tiny", "tiny", 1, 2, 0, 0), ("/m/big", "big", 1, 1, 2, 4096)]
    for wrong, why in (("model=/m/x,decode=0", "decode: Input should be greater"),
                       ("model=/m/x,size=2", "size: Extra inputs are not permitted"),
                       ("model=/m/x,prefill", "'prefill' in 'model=/m/x,prefill' is not "
                                              "KEY=VALUE")):
        with pytest.raises(SystemExit):
            parsed(["--add-model", wrong])
        assert why in capsys.readouterr().err
    assert from_arguments(LauncherConfig, parsed([])).models == []  # one model, as before


def test_the_settings_file_lists_models_as_mappings() -> None:
    file = parse_config("launcher:\n  models:\n    - model: /m/tiny\n      name: tiny\n"
                        "      prefill: 0\n", "stack.yaml")
    args = argparse.Namespace(**{CONFIG_DEST: file})
    assert from_arguments(LauncherConfig, args).models == [
        ModelPool(model="/m/tiny", name="tiny", prefill=0)]
    with pytest.raises(ValueError, match=r"stack\.yaml: launcher\.models"):
        parse_config("launcher:\n  models:\n    - name: no-folder\n", "stack.yaml")
    # `config show` prints them as such a list, which loads back.
    shown = show(build_parser().parse_args(["up", "--add-model", "model=/m/tiny,tp=2"]), "up")
    again = parse_config(shown, "shown.yaml").values_for(LauncherConfig)["models"]
    assert again == [{"model": "/m/tiny", "name": "", "prefill": 1, "decode": 1,
                      "max_model_len": 0, "kv_cache_gib": 0, "tp": 2}]


def test_two_models_under_one_name_are_refused(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    engine = EngineConfig(model=str(tmp_path / "a"))
    check_models(engine, [ModelPool(model=str(tmp_path / "b"))])
    with pytest.raises(ModelsRefused, match="the name 'a' is served already"):
        check_models(engine, [ModelPool(model=str(tmp_path / "a"))])
    with pytest.raises(ModelsRefused, match="no HF-format model"):
        check_models(engine, [ModelPool(model=str(tmp_path / "c"))])
    with pytest.raises(ModelsRefused, match="live planner"):
        check_models(engine, [ModelPool(model=str(tmp_path / "b"))], planner=True)


def test_each_model_has_its_own_pools_and_actors() -> None:
    tiny = ModelPool(model="/m/tiny", name="tiny", prefill=0, decode=2, max_model_len=256,
                     tp=2)
    assert Pool.parse("decode") == Pool("decode", "decode", 0)
    assert Pool.parse("m1-prefill") == Pool("m1-prefill", "prefill", 1)
    assert [(p.key, n) for p, n in extra_pools([tiny])] == [("m1-prefill", 0),
                                                             ("m1-decode", 2)]
    stack = Stack(LauncherConfig(prefill_cores="0", decode_cores="1", models=[tiny]),
                  EngineConfig(model="/m/smol", lora_modules="sql=/a/sql"), ServerConfig(),
                  WorkerConfig(), RouterConfig())
    specs = ActorSpecs(stack, "redis://127.0.0.1:1/0", secret="")
    spec = specs.spec("m1-decode", 1)
    assert isinstance(spec.args, WorkerArgs)
    engine = spec.args.engine
    assert (spec.options.name, spec.options.role, spec.args.worker.worker_id) == (
        "m1-decode-1", "decode", "m1-decode-1")
    assert (engine.model, engine.served_model_name, engine.max_model_len,
            engine.tensor_parallel_size, engine.lora_modules, engine.cpu_cores) == (
        "/m/tiny", "tiny", 256, 2, "", "1")
    default = specs.spec("decode", 0).args
    assert isinstance(default, WorkerArgs)
    assert (default.engine.model, default.engine.lora_modules) == ("/m/smol", "sql=/a/sql")
    router = specs.spec("router", 0).args
    assert isinstance(router, RouterArgs)
    assert router.router.router_models == "smol=/m/smol,tiny=/m/tiny"
    assert router.router.router_model == "/m/smol"


def test_top_shows_each_workers_model() -> None:
    assert cells(row(model="tiny"))[COLUMNS.index("model")] == "tiny"
    assert cells(row())[COLUMNS.index("model")] == "-"  # an older record
