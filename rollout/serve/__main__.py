"""python -m rollout.serve --model PATH [--host 127.0.0.1] [--port 30000] [--api-key KEY] [engine options]

Engine options are EngineConfig's fields as flags (--max-total-tokens 4096, --no-cuda-graph, ...).
The engine runs in a child process (ProcessAsyncEngine) so the HTTP work never holds up its step loop;
--engine-mode thread keeps it in a thread of the server's process (AsyncEngine).
--tool-call-parser NAME and --reasoning-parser NAME split chat outputs into tool_calls and
reasoning_content (rollout/parsers; an unknown name stops the server, listing the known ones).
--api-server-count N runs N server processes over the one engine process (rollout/serve/processes.py).
SIGTERM or Ctrl-C: stop accepting, let the open requests finish (or abort them after
--graceful-shutdown-s: each stream then ends with a finish_reason "abort" chunk and [DONE]), shut the
engine down, exit 0. If the engine worker dies, the server answers 503, fails /health, and exits 1
(a supervisor restarts it; docs/reliability.md).
Security flags (docs/security.md): --api-key, --allowed-hosts, --max-body-bytes, and the opt-in
--allow-pickle-weight-updates-unsafe.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import typing
from pathlib import Path

from rollout.config import EngineConfig
from rollout.serve.bounds import Bounds
from rollout.serve.guard import allowed_hosts
from rollout.serve.policy import Policy
from rollout.usage import die, mistake

log = logging.getLogger("rollout")


def _engine_flags(ap: argparse.ArgumentParser) -> list[str]:
    """One flag per EngineConfig field but the model; returns the field names."""
    hints = typing.get_type_hints(EngineConfig)
    names = []
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        kind = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        doc = f"EngineConfig.{f.name}"  # a help text, so --help shows the default
        if kind is bool:
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=doc)
        else:
            base = next((t for t in (int, float, str) if t in typing.get_args(kind) or t is kind), str)
            ap.add_argument(flag, type=base, default=f.default, help=doc)
        names.append(f.name)
    return names


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict]:
    ap = argparse.ArgumentParser(
        prog="python -m rollout.serve",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--model", default=None, help="HF checkpoint folder (default: the built-in tiny model)")
    ap.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: the folder's)"
    )
    ap.add_argument("--host", default="127.0.0.1", help="the address to bind")
    ap.add_argument("--port", type=int, default=30000, help="the port to listen on")
    ap.add_argument(
        "--api-key",
        default=None,
        help="require Authorization: Bearer KEY (all but /health); turns /docs, /redoc, /openapi.json off",
    )
    ap.add_argument(
        "--allowed-hosts",
        default="",
        help="comma-separated Host header names answered besides the bound address (DNS-rebinding defence; "
        "'*': any)",
    )
    ap.add_argument(
        "--allow-pickle-weight-updates-unsafe",
        action="store_true",
        help="unpickle SGLang's /update_weights_from_tensor payloads: runs code of any client's choosing; "
        "needs --api-key",
    )
    ap.add_argument(
        "--max-body-bytes", type=int, default=Policy.max_body_bytes, help="request body cap (413)"
    )
    ap.add_argument(
        "--max-weight-body-bytes",
        type=int,
        default=Policy.max_weight_body_bytes,
        help="body cap of /update_weights_from_tensor",
    )
    ap.add_argument(
        "--max-n", type=int, default=Bounds.max_n, help="the most samples per prompt (n, best_of)"
    )
    ap.add_argument("--max-top-logprobs", type=int, default=Bounds.max_top_logprobs)
    ap.add_argument("--max-prompts-per-request", type=int, default=Bounds.max_prompts)
    ap.add_argument(
        "--max-request-tokens",
        type=int,
        default=Bounds.max_request_tokens,
        help="the most tokens one request may need: n * (prompt + max_tokens) over its prompts",
    )
    ap.add_argument("--max-queued-requests", type=int, default=4096, help="more in flight: answer 503")
    ap.add_argument(
        "--graceful-shutdown-s",
        type=float,
        default=30.0,
        help="on SIGTERM, how long open requests may run before they are aborted",
    )
    ap.add_argument(
        "--engine-mode",
        choices=["process", "thread"],
        default="process",
        help="the step loop in a child process (default) or in a thread of the server's process",
    )
    ap.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="HTTP server processes over the one engine process (the HTTP and JSON work of many streams "
        "spread over cores); --max-queued-requests is shared out among them",
    )
    ap.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="stream a chunk each N tokens (the first at once): less HTTP and JSON work per token",
    )
    ap.add_argument(
        "--tool-call-parser",
        default=None,
        help="split chat outputs' tool calls into message.tool_calls (hermes, qwen3_coder, llama3_json, "
        "mistral, pythonic)",
    )
    ap.add_argument(
        "--reasoning-parser",
        default=None,
        help="split chat outputs' <think> blocks into reasoning_content (qwen3, deepseek_r1)",
    )
    names = _engine_flags(ap)
    args = ap.parse_args(argv)
    from rollout.parsers import reasoning_parser_names, tool_parser_names
    from rollout.serve.chat import ChatParsers

    for flag, name, known in [
        ("--tool-call-parser", args.tool_call_parser, tool_parser_names()),
        ("--reasoning-parser", args.reasoning_parser, reasoning_parser_names()),
    ]:  # an unknown parser stops the server here, before the engine loads, with the known names
        if name is not None and name not in known:
            ap.error(f"{flag}: unknown {name!r}; known: {', '.join(known)}")
    args.parsers = ChatParsers(args.tool_call_parser, args.reasoning_parser)
    if args.stream_interval < 1:
        ap.error(f"--stream-interval must be >= 1, got {args.stream_interval}")
    if args.api_server_count < 1:
        ap.error(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.api_server_count > 1 and args.engine_mode != "process":
        ap.error("--api-server-count > 1 needs --engine-mode process (the servers attach to its process)")
    if args.allow_pickle_weight_updates_unsafe and not args.api_key:
        die(
            ap.prog,
            "--allow-pickle-weight-updates-unsafe needs --api-key (unpickling runs the sender's code)",
        )
    wrong = mistake(args.model, args.device)
    if wrong:
        die(ap.prog, wrong)
    try:
        args.policy = Policy(
            allowed_hosts=allowed_hosts(args.host, args.allowed_hosts.split(",")),
            max_body_bytes=args.max_body_bytes,
            max_weight_body_bytes=args.max_weight_body_bytes,
            allow_pickle=args.allow_pickle_weight_updates_unsafe,
            bounds=Bounds(
                args.max_n, args.max_top_logprobs, args.max_prompts_per_request, args.max_request_tokens
            ),
        )
    except ValueError as e:
        die(ap.prog, str(e))
    options = {
        n: getattr(args, n) for n in names if getattr(args, n) != EngineConfig.__dataclass_fields__[n].default
    }
    return args, options


def main(argv: list[str] | None = None) -> None:
    import math
    import os
    import signal

    from rollout.fronts.async_engine import AsyncEngine
    from rollout.fronts.async_process import ProcessAsyncEngine
    from rollout.models.toy import default_model_dir
    from rollout.serve import processes as P
    from rollout.serve.app import build_app

    args, options = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = args.model or str(default_model_dir())
    count = args.api_server_count
    settings = P.ServeSettings(
        model_name=args.served_model_name or Path(model).name,
        api_key=args.api_key,
        max_queued_requests=math.ceil(args.max_queued_requests / count),
        graceful_shutdown_s=args.graceful_shutdown_s,
        stream_interval=args.stream_interval,
        parsers=args.parsers,
        policy=args.policy,
    )
    try:
        sock = P.bind(args.host, args.port)  # before the engine starts: a port in use fails at once
    except OSError as e:
        die("python -m rollout.serve", f"cannot listen on {args.host}:{args.port}: {e.strerror or e}")
    kind = ProcessAsyncEngine if args.engine_mode == "process" else AsyncEngine
    limits = dict(max_queued_requests=settings.max_queued_requests, stream_interval=args.stream_interval)
    engine = kind(model, **limits, **options)
    fronts = P.start_fronts(count - 1, *engine.listen(), sock, settings) if count > 1 else []

    def stop_fronts() -> None:
        P.stop_fronts(fronts, args.graceful_shutdown_s + P.STOP_GRACE_S)

    def pass_on(sig: int) -> None:  # the other servers drain while this one does
        for p in fronts:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    app = build_app(
        engine,
        model_name=settings.model_name,
        api_key=args.api_key,
        before_shutdown=stop_fronts,
        parsers=settings.parsers,
        policy=settings.policy,
    )
    log.info(
        "serving %s on http://%s:%d (%d server process%s)",
        model,
        args.host,
        args.port,
        count,
        "es" if count > 1 else "",
    )
    watch = P.EngineWatch(engine)
    # SIGTERM/SIGINT: stop, drain, abort what is left, shut the engine down
    P.run_app(app, settings, [sock], on_exit=pass_on, on_start=watch.start)
    if watch.died:
        log.error("the engine worker died; exiting 1 (restart the server to serve again)")
        stop_fronts()
        raise SystemExit(1)


if __name__ == "__main__":
    main()
