"""`specserve serve`."""

from __future__ import annotations

import argparse

from specserve.cli_args import add_engine_args, engine_kwargs

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20  # as specserve.server.limits (not imported: it loads uvicorn)


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
    srv.add_argument(
        "--per-request-spec-decode-metrics",
        action="store_true",
        help="each response's usage.speculative_decoding: its drafts, draft tokens, accepted tokens (in all "
        "and per position) and mean acceptance length",
    )
    limits = srv.add_argument_group("request limits and timeouts")
    limits.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies get 413, refused before they are parsed",
    )
    limits.add_argument(
        "--request-read-timeout",
        type=float,
        default=30.0,
        help="seconds a client gets to send a request's headers, and then its body (408); stalled "
        "connections are closed",
    )
    limits.add_argument(
        "--timeout-keep-alive", type=float, default=5.0, help="seconds idle keep-alive connections stay open"
    )
    limits.add_argument("--max-messages", type=int, default=2048, help="chat messages per request (400)")
    limits.add_argument("--max-stop-strings", type=int, default=64, help="stop strings per request (400)")
    limits.add_argument(
        "--max-prompt-token-ids",
        type=int,
        default=2**20,
        help="token ids a completions request may send, all its prompts together (400)",
    )
    limits.add_argument(
        "--reject-special-tokens-in-content",
        action="store_true",
        help="answer 400 to chat messages whose content holds a special token of the tokenizer (say "
        "<|im_start|>), which would otherwise become a real control token",
    )
    limits.add_argument(
        "--max-constraint-bytes",
        type=int,
        default=64 * 1024,
        help="size of one output constraint or tool schema (a regex, grammar, choice list or JSON schema) "
        "(400)",
    )
    limits.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=10.0,
        help="seconds a request's constraints and tool schemas get to compile (400)",
    )
    limits.add_argument(
        "--tokenizer-workers", type=int, default=2, help="threads that render and tokenize prompts"
    )
    srv.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from specserve.server import serve
    from specserve.server.limits import ServerLimits

    limits = ServerLimits(
        max_request_body_bytes=args.max_request_body_bytes,
        request_read_timeout_s=args.request_read_timeout,
        timeout_keep_alive_s=args.timeout_keep_alive,
        max_messages=args.max_messages,
        max_stop_strings=args.max_stop_strings,
        max_prompt_token_ids=args.max_prompt_token_ids,
        reject_special_tokens_in_content=args.reject_special_tokens_in_content,
        max_constraint_bytes=args.max_constraint_bytes,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
    )
    return serve(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_waiting=args.max_waiting_requests,
        drain_timeout_s=args.shutdown_timeout,
        log_stats_interval_s=args.log_stats_interval,
        limits=limits,
        tokenizer_workers=args.tokenizer_workers,
        per_request_spec_decode_metrics=args.per_request_spec_decode_metrics,
        **engine_kwargs(args),
    )
