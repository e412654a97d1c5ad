"""Tensor parallelism in the settings: per-rank core binding, the engine's arguments, the
per-role sizes of `serve --mode disagg` and `pdserve up` (Ray options included), and the
refusals that come before any engine starts. Plain objects: no engine, no Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.cli import build_parser
from services.engine.config import EngineConfig, omp_threads_bind, rank_core_groups
from services.kv.tp_layout import kv_workers_tp_problem
from services.launcher.actor_spec import ActorSpecs, RayOptions, WorkerArgs
from services.launcher.placement import ranks_warning, stack_warning
from services.launcher.settings import LauncherConfig, Stack, role_engine, role_tp
from services.router.config import RouterConfig
from services.server.settings import ServerConfig
from services.settings import from_arguments
from services.worker.config import WorkerConfig


@pytest.mark.parametrize(("cores", "ranks", "groups"), [
    ([0, 1], 1, [[0, 1]]),
    ([0, 1], 2, [[0], [1]]),
    ([0, 1, 2, 3], 2, [[0, 1], [2, 3]]),
    ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]),
    ([4, 5, 6], 3, [[4], [5], [6]]),
    ([1], 2, [[1], [1]]),  # oversubscribed: both ranks on the one core
    ([0, 1, 2], 4, [[0], [1], [2], [0]]),
])
def test_rank_core_groups(cores: list[int], ranks: int, groups: list[list[int]]) -> None:
    assert rank_core_groups(cores, ranks) == groups
    # every core is used, and each rank has at least one
    assert {c for g in groups for c in g} == set(cores) and all(groups)


def test_rank_core_groups_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="ranks"):
        rank_core_groups([0], 0)
    with pytest.raises(ValueError, match="no cores"):
        rank_core_groups([], 1)


def test_the_binding_is_vllms_format() -> None:
    assert omp_threads_bind([1, 0], 2) == "0|1"
    assert omp_threads_bind([0, 1, 2, 3], 2) == "0,1|2,3"
    assert EngineConfig(cpu_cores="0-3", tensor_parallel_size=2).threads_bind() == "0,1|2,3"
    assert EngineConfig(cpu_cores="0-1").threads_bind() == "0,1"
    env = EngineConfig(cpu_cores="0-1", tensor_parallel_size=2).vllm_env()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"


def test_pipeline_parallelism_is_refused_in_words() -> None:
    with pytest.raises(ValidationError, match="pipeline parallelism is not supported"):
        EngineConfig(pipeline_parallel_size=2)
    with pytest.raises(ValidationError):
        EngineConfig(tensor_parallel_size=0)


def tiny_folder(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2}))
    return tmp_path


def test_engine_args_carry_the_size_and_the_mp_executor(tmp_path: Path) -> None:
    from services.engine.engine import Engine

    model = str(tiny_folder(tmp_path))
    two = Engine(EngineConfig(model=model, tensor_parallel_size=2)).engine_args()
    assert two.tensor_parallel_size == 2 and two.distributed_executor_backend == "mp"
    one = Engine(EngineConfig(model=model)).engine_args()
    assert one.tensor_parallel_size == 1 and one.distributed_executor_backend is None


def test_an_engine_whose_heads_do_not_split_refuses_before_spawning(tmp_path: Path) -> None:
    from services.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_folder(tmp_path)), tensor_parallel_size=3))
    with pytest.raises(ValueError, match="4 attention heads do not split over 3"):
        engine.start()
    assert engine._llm is None


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(list(argv))


def test_disagg_and_up_take_per_role_sizes_and_single_roles_one() -> None:
    args = parse("serve", "--mode", "disagg", "--prefill-tp", "2", "--decode-tp", "4")
    launcher = from_arguments(LauncherConfig, args)
    engine = from_arguments(EngineConfig, args)
    assert (role_tp(launcher, engine, "prefill"), role_tp(launcher, engine, "decode")) == (2, 4)
    args = parse("up", "--tensor-parallel-size", "2", "--decode-tp", "1")
    launcher, engine = from_arguments(LauncherConfig, args), from_arguments(EngineConfig, args)
    assert (role_tp(launcher, engine, "prefill"), role_tp(launcher, engine, "decode")) == (2, 1)
    for role in ("prefill", "decode"):
        args = parse(role, "--tensor-parallel-size", "2")
        assert from_arguments(EngineConfig, args).tensor_parallel_size == 2
        with pytest.raises(SystemExit):
            parse(role, "--prefill-tp", "2")
    engine = from_arguments(EngineConfig, parse("serve", "--tensor-parallel-size", "2"))
    assert engine.tensor_parallel_size == 2


def test_role_engine_sets_cores_and_size() -> None:
    launcher = LauncherConfig(prefill_tp=2)
    engine = role_engine(launcher, EngineConfig(), "prefill", "0-3")
    assert (engine.cpu_cores, engine.tensor_parallel_size) == ("0-3", 2)
    assert role_engine(launcher, EngineConfig(), "decode", "4").tensor_parallel_size == 1


def stack(launcher: LauncherConfig, engine: EngineConfig | None = None) -> Stack:
    return Stack(launcher, engine or EngineConfig(), ServerConfig(), WorkerConfig(),
                 RouterConfig())


def test_actor_specs_give_each_role_its_size() -> None:
    specs = ActorSpecs(stack(LauncherConfig(prefill_cores="0-1", decode_cores="2",
                                            prefill_tp=2)), "redis://127.0.0.1:1/0", "")
    prefill, decode = specs.spec("prefill", 0), specs.spec("decode", 0)
    assert isinstance(prefill.args, WorkerArgs) and isinstance(decode.args, WorkerArgs)
    assert prefill.args.engine.tensor_parallel_size == 2
    assert prefill.args.engine.threads_bind() == "0|1"
    assert decode.args.engine.tensor_parallel_size == 1
    assert (prefill.options.ranks, decode.options.ranks) == (2, 1)
    assert specs.spec("router", 0).options.ranks == 1


def test_a_multi_gpu_worker_is_one_actor_in_a_group_of_one_bundle_per_rank() -> None:
    options = RayOptions.of(LauncherConfig(decode_accelerator="H200"), "decode", "decode-0",
                            ranks=4)
    bundles = options.bundles()
    assert len(bundles) == 4 and all(b["GPU"] == 1 for b in bundles)
    assert all(b["accelerator_type:H200"] > 0 for b in bundles)
    # the actor's own role resource is in the first bundle, where the actor is placed
    assert bundles[0]["pdserve_decode"] == 1 and "pdserve_decode" not in bundles[1]
    kwargs = options.kwargs()
    assert kwargs["num_gpus"] == 0 and "accelerator_type" not in kwargs
    assert kwargs["resources"] == {"pdserve_decode": 1}


def test_cpu_and_one_gpu_workers_need_no_group() -> None:
    cpu = RayOptions.of(LauncherConfig(), "prefill", "prefill-0", ranks=2)
    assert cpu.bundles() == [] and cpu.kwargs()["num_cpus"] == 0
    gpu = RayOptions.of(LauncherConfig(prefill_accelerator="H100"), "prefill", "prefill-0")
    assert gpu.bundles() == [] and gpu.kwargs()["num_gpus"] == 1


def test_fewer_cores_than_ranks_is_said() -> None:
    assert ranks_warning("prefill", "0-1", 2) == ""
    warning = ranks_warning("prefill", "0", 2)
    assert "2 tensor-parallel ranks on core 0" in warning and "--prefill-tp" in warning
    launcher = LauncherConfig(prefill_cores="0", decode_cores="1", prefill_tp=2)
    assert "each prefill worker runs 2" in stack_warning(stack(launcher), 1, 1)
    assert stack_warning(stack(LauncherConfig(prefill_cores="0", decode_cores="1")), 1, 1) == ""


@pytest.mark.parametrize(("a", "b"), [(1, 1), (2, 1), (1, 2), (2, 2), (8, 3)])
def test_kv_workers_of_any_tp_sizes_may_pair(a: int, b: int) -> None:
    # Whether a model's heads split over a size is the model's question (below).
    assert kv_workers_tp_problem(a, b) == ""
    assert "prefill TP 0" in kv_workers_tp_problem(0, 1)
    assert "decode TP 0" in kv_workers_tp_problem(1, 0)


def test_a_kv_worker_refuses_a_tp_its_model_cannot_split_before_its_engine_starts() -> None:
    from services.worker.worker import Worker

    # The default model has 9 attention heads and 3 KV heads.
    with pytest.raises(ValueError, match=r"do not split over 2 ranks"):
        Worker.start("decode", EngineConfig(tensor_parallel_size=2), WorkerConfig())


def test_a_settings_file_sets_the_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in [k for k in os.environ if k.startswith("PDSERVE_")]:
        monkeypatch.delenv(key)
    config = tmp_path / "stack.yaml"
    config.write_text("engine:\n  tensor_parallel_size: 2\nlauncher:\n  decode_tp: 4\n")
    args = parse("up", "--config", str(config))
    launcher, engine = from_arguments(LauncherConfig, args), from_arguments(EngineConfig, args)
    assert (role_tp(launcher, engine, "prefill"), role_tp(launcher, engine, "decode")) == (2, 4)
    args = parse("decode", "--config", str(config))
    assert from_arguments(EngineConfig, args).tensor_parallel_size == 2
