"""`arborlm serve` / `python -m arborlm.server`: load the engine, then serve HTTP with uvicorn.

Flags are generated from the two option dataclasses, so each is documented once: the server's
own (`ServerArgs`) and the engine's (`EngineArgs`, under SGLang's flag names). The engine is
loaded before the socket opens; once the server listens it logs one "ready" line with its
address. SIGTERM (or Ctrl-C) stops accepting connections, lets in-flight requests finish for
up to `--drain-timeout` seconds, shuts the engine down and exits with status 0. In multiprocess
mode an engine process that dies is replaced (see `MultiProcessClient`); when that fails
`--engine-restart-attempts` times in a row the server stops the same way and exits with status
3 (`ENGINE_FAILED_EXIT`), so that a supervisor restarts it. Importing this module is cheap:
FastAPI, uvicorn and the engine load inside `serve_main`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from arborlm.server.server_args import ServerArgs

logger = logging.getLogger("arborlm.server")

# EngineArgs fields whose SGLang flag name differs from the field name.
SGLANG_FLAG_NAMES = {"mem_fraction": "--mem-fraction-static"}
_TYPES = {"int": int, "float": float, "str": str}
ENGINE_FAILED_EXIT = 3  # the engine died and could not be started again


def _choices() -> dict[str, tuple[str, ...]]:
    """Option name -> its allowed values, from the enums that declare them."""
    from arborlm.routing.policy import SGLANG_METHODS
    from arborlm.runtime.config import (
        AttentionBackend,
        DType,
        EngineMode,
        GrammarBackendName,
        SchedulePolicy,
        choices,
    )
    from arborlm.server.server_args import LogLevel

    kinds = {"engine_mode": EngineMode, "log_level": LogLevel, "dtype": DType,
             "schedule_policy": SchedulePolicy, "attention_backend": AttentionBackend,
             "grammar_backend": GrammarBackendName}
    return {**{name: choices(kind) for name, kind in kinds.items()},
            "load_balance_method": tuple(SGLANG_METHODS)}


def _add_fields(group: Any, cls: type, skip: tuple[str, ...] = ()) -> None:
    allowed = _choices()
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = SGLANG_FLAG_NAMES.get(f.name, "--" + f.name.replace("_", "-"))
        kind = str(f.type).split("|")[0].strip()
        help_text = f.metadata.get("help", "")
        if kind == "bool" and f.default is None:  # on, off, or decided by the engine
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
            continue
        if kind == "bool":
            group.add_argument(flag, dest=f.name, action="store_true", help=help_text)
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        if default is not None:
            help_text += f" (default: {default})"
        group.add_argument(flag, dest=f.name, type=_TYPES[kind], default=None,
                           choices=allowed.get(f.name), help=help_text)


def build_parser() -> argparse.ArgumentParser:
    from arborlm.runtime.config import EngineArgs
    from arborlm.server.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog="arborlm serve",
        description="Serve a model over HTTP: SGLang's native API (/generate, ...) and an "
                    "OpenAI-compatible API (/v1/completions, /v1/chat/completions).")
    parser.add_argument("--model-path", default=None,
                        help="Hugging Face model directory or .gguf file (default: "
                             "SmolLM2-135M-Instruct, fetched once into the cache; "
                             "random-llama-40m: the built-in random-weight model).")
    _add_fields(parser.add_argument_group("server"), ServerArgs)
    _add_fields(parser.add_argument_group("engine"), EngineArgs, skip=("model_path",))
    return parser


def parse_args(argv: list[str]) -> tuple[ServerArgs, Any]:
    from arborlm.runtime.config import EngineArgs
    from arborlm.server.server_args import ServerArgs

    values = vars(build_parser().parse_args(argv))

    def pick(cls: type) -> dict[str, Any]:  # the flags given (store_true ones when set)
        given = {f.name for f in dataclasses.fields(cls) if f.default is None}
        names = {f.name for f in dataclasses.fields(cls)}
        return {k: v for k, v in values.items()
                if k in names and v is not None and (v is not False or k in given)}

    engine = pick(EngineArgs)
    engine["model_path"] = values["model_path"]
    return ServerArgs(**pick(ServerArgs)), EngineArgs(**engine)


def serve_main(argv: list[str]) -> int:
    server_args, engine_args = parse_args(argv)
    logging.basicConfig(level=server_args.log_level.upper(), force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _exit_on_signal)
    from arborlm.errors import InvalidRequestError, ModelLoadError
    from arborlm.runtime.config import EngineMode

    if engine_args.node_rank > 0:
        return _serve_ranks(engine_args)
    logger.info("loading %s (engine: %s)",
                engine_args.model_path or "the default model (SmolLM2-135M-Instruct)",
                server_args.engine_mode)
    engine_failed = threading.Event()
    options = {}
    if server_args.engine_mode == EngineMode.MULTIPROCESS:
        from arborlm.runtime.multiprocess_client import RestartPolicy

        options = {"restart": RestartPolicy(attempts=server_args.engine_restart_attempts),
                   "on_fatal": lambda reason: engine_failed.set()}
    try:
        client = _create_client(engine_args, server_args, options)
    except (InvalidRequestError, ModelLoadError, ValueError) as e:
        logger.error("cannot start the engine: %s", e)
        return 2
    try:
        code = _serve(client, server_args, engine_args, engine_failed)
    finally:
        client.shutdown()
    if engine_failed.is_set():
        logger.error("exiting with status %d: the engine could not be restarted",
                     ENGINE_FAILED_EXIT)
        return ENGINE_FAILED_EXIT
    return code


def _serve_ranks(engine_args: Any) -> int:
    """A node other than 0 of a multi-node engine: only its tensor-parallel ranks, which take
    their model and options from node 0 (no HTTP here)."""
    from arborlm.errors import InvalidRequestError
    from arborlm.runtime.distributed.launch import run_node_ranks

    try:
        engine_args.check_parallel()
    except InvalidRequestError as e:
        logger.error("cannot start the ranks: %s", e)
        return 2
    return run_node_ranks(engine_args)


def _create_client(engine_args: Any, server_args: ServerArgs, options: dict[str, Any]) -> Any:
    """The engine client: one engine, or `--dp-size` replicas behind a `DataParallelClient`."""
    from arborlm.runtime.config import EngineMode
    from arborlm.runtime.engine import create_client

    if server_args.dp_size < 1:
        raise ValueError(f"--dp-size must be at least 1, got {server_args.dp_size}")
    if server_args.dp_size == 1:
        return create_client(engine_args, server_args.engine_mode, **options)
    if server_args.engine_mode != EngineMode.MULTIPROCESS:
        raise ValueError("--dp-size above 1 needs --engine-mode multiprocess")
    from arborlm.routing.policy import create_policy
    from arborlm.runtime.data_parallel_client import DataParallelClient

    return DataParallelClient(engine_args, server_args.dp_size,
                              create_policy(server_args.load_balance_method), **options)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _serve(client: Any, server_args: ServerArgs, engine_args: Any,
           engine_failed: threading.Event) -> int:
    import uvicorn

    from arborlm.server.app import create_app
    from arborlm.server.uvicorn_server import ArborServer

    app = create_app(client, server_args, engine_args)
    config = uvicorn.Config(
        app, host=server_args.host, port=server_args.port, log_config=None,
        log_level=server_args.log_level, access_log=server_args.log_level == "debug",
        timeout_graceful_shutdown=server_args.drain_timeout,
        timeout_keep_alive=server_args.timeout_keep_alive, lifespan="on")
    replicas = f", {server_args.dp_size} replicas" if server_args.dp_size > 1 else ""
    server = ArborServer(config, ready_note=f"model {client.config.model.path}, "
                                            f"engine {server_args.engine_mode}{replicas}",
                         stop_when=engine_failed)
    server.run()
    return 0 if server.started else 1


def main() -> None:
    raise SystemExit(serve_main(sys.argv[1:]))
