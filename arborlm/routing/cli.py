"""`arborlm router`: SGLang's native and OpenAI's routes in front of `arborlm serve` workers.

`arborlm router --worker-urls http://host:30001 http://host:30002 [--policy cache_aware]
[--host --port]` serves the router app (`router_app.py`) with uvicorn and logs the same
"ready" line as the server. Workers may also be added and removed while it runs
(`/add_worker?url=`, `/remove_worker?url=`). The policy's knobs take SGLang router's flag names.
The router loads no model and imports no engine code.
"""

from __future__ import annotations

import argparse
import logging

from arborlm.routing.policy import SGLANG_METHODS, CacheAwareConfig

DEFAULTS = CacheAwareConfig()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="arborlm router",
        description="Route requests (native /generate, OpenAI /v1/completions and "
                    "/v1/chat/completions, streaming included) to `arborlm serve` workers.")
    parser.add_argument("--worker-urls", nargs="*", default=[], metavar="URL",
                        help="workers' base URLs, e.g. http://127.0.0.1:30001 (more can be "
                             "added at run time with POST /add_worker?url=URL)")
    parser.add_argument("--policy", default="cache_aware", choices=list(SGLANG_METHODS),
                        help="routing policy (default: cache_aware)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=30000,
                        help="port to listen on; 0 picks a free one (the ready line shows it)")
    parser.add_argument("--cache-threshold", type=float, default=DEFAULTS.cache_threshold,
                        help="cache_aware: route by prefix when the matched prefix covers more "
                             "than this fraction of the text")
    parser.add_argument("--balance-abs-threshold", type=int,
                        default=DEFAULTS.balance_abs_threshold,
                        help="cache_aware: load counts as imbalanced when the busiest worker "
                             "has more than this many requests above the idlest ...")
    parser.add_argument("--balance-rel-threshold", type=float,
                        default=DEFAULTS.balance_rel_threshold,
                        help="... and more than this many times its count; then the shortest "
                             "queue wins")
    parser.add_argument("--max-tree-size", type=int, default=DEFAULTS.max_tree_size,
                        help="cache_aware: characters of served text remembered per worker")
    parser.add_argument("--max-attempts", type=int, default=3,
                        help="workers a request is tried on when a worker gives no answer")
    parser.add_argument("--health-check-interval", type=float, default=10.0,
                        help="seconds between /health checks of every worker")
    parser.add_argument("--health-check-timeout", type=float, default=5.0,
                        help="seconds a /health check may take")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error", "critical"])
    return parser


def router_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_attempts < 1:
        raise SystemExit("--max-attempts must be at least 1")
    if args.health_check_interval <= 0 or args.health_check_timeout <= 0:
        raise SystemExit("--health-check-interval and --health-check-timeout must be > 0")
    import httpx
    import uvicorn

    from arborlm.routing.policy import create_policy
    from arborlm.routing.router_app import RouterOptions, create_router_app
    from arborlm.routing.workers import WorkerPool
    from arborlm.server.uvicorn_server import ArborServer

    try:
        policy = create_policy(args.policy, CacheAwareConfig(
            cache_threshold=args.cache_threshold,
            balance_abs_threshold=args.balance_abs_threshold,
            balance_rel_threshold=args.balance_rel_threshold,
            max_tree_size=args.max_tree_size))
        client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                   limits=httpx.Limits(max_connections=None,
                                                       max_keepalive_connections=64))
        pool = WorkerPool(args.worker_urls, policy, client, args.health_check_timeout)
    except ValueError as e:
        raise SystemExit(f"arborlm router: {e}") from e
    app = create_router_app(pool, RouterOptions(args.max_attempts, args.health_check_interval))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None,
                            log_level=args.log_level, access_log=args.log_level == "debug",
                            lifespan="on")
    server = ArborServer(config, ready_note=f"router, policy {args.policy}, "
                                            f"{len(pool.workers)} worker(s)")
    server.run()
    return 0 if server.started else 1


def main() -> None:
    import sys

    raise SystemExit(router_main(sys.argv[1:]))


if __name__ == "__main__":
    main()
