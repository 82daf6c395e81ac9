"""`specserve serve`."""

from __future__ import annotations

import argparse

from specserve.cli_args import add_engine_args, engine_kwargs


def register(sub: argparse._SubParsersAction) -> None:
    srv = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)"
    )
    add_engine_args(srv, model_positional=True)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    srv.add_argument("--served-model-name", default=None, help="the name clients pass as 'model'")
    srv.add_argument(
        "--max-waiting-requests", type=int, default=256, help="beyond the running batch; more get 429"
    )
    srv.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM"
    )
    srv.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds between engine stats")
    srv.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from specserve.server import serve

    return serve(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_waiting=args.max_waiting_requests,
        drain_timeout_s=args.shutdown_timeout,
        log_stats_interval_s=args.log_stats_interval,
        **engine_kwargs(args),
    )
