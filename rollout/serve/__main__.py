"""python -m rollout.serve --model PATH [--host 127.0.0.1] [--port 30000] [--api-key KEY] [engine options]

Engine options are EngineConfig's fields as flags (--max-total-tokens 4096, --no-cuda-graph, ...).
The engine runs in a child process (ProcessAsyncEngine) so the HTTP work never holds up its step loop;
--engine-mode thread keeps it in a thread of the server's process (AsyncEngine).
SIGTERM or Ctrl-C: stop accepting, let the open requests finish (or abort them after
--graceful-shutdown-s), shut the engine down, exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import signal
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollout.config import EngineConfig


def _engine_flags(ap: argparse.ArgumentParser) -> list[str]:
    """One flag per EngineConfig field but the model; returns the field names."""
    hints = typing.get_type_hints(EngineConfig)
    names = []
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        kind = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            base = next((t for t in (int, float, str) if t in typing.get_args(kind) or t is kind), str)
            ap.add_argument(flag, type=base, default=f.default)
        names.append(f.name)
    return names


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict]:
    ap = argparse.ArgumentParser(prog="python -m rollout.serve", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF checkpoint folder (default: the built-in tiny model)")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (all but /health)")
    ap.add_argument("--max-queued-requests", type=int, default=4096, help="more in flight: answer 503")
    ap.add_argument("--graceful-shutdown-s", type=float, default=30.0)
    ap.add_argument(
        "--engine-mode",
        choices=["process", "thread"],
        default="process",
        help="the step loop in a child process (default) or in a thread of the server's process",
    )
    names = _engine_flags(ap)
    args = ap.parse_args(argv)
    options = {
        n: getattr(args, n) for n in names if getattr(args, n) != EngineConfig.__dataclass_fields__[n].default
    }
    return args, options


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from rollout.async_engine import AsyncEngine
    from rollout.async_process import ProcessAsyncEngine
    from rollout.serve.app import build_app
    from rollout.toy import default_model_dir

    args, options = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = args.model or str(default_model_dir())
    kind = ProcessAsyncEngine if args.engine_mode == "process" else AsyncEngine
    engine = kind(model, max_queued_requests=args.max_queued_requests, **options)
    app = build_app(engine, model_name=args.served_model_name or Path(model).name, api_key=args.api_key)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=args.graceful_shutdown_s,
        backlog=4096,
        limit_concurrency=None,
    )
    _server_class(uvicorn)(config).run()  # SIGTERM/SIGINT: stop accepting, drain, shut the engine down


def _server_class(uvicorn: Any) -> type:
    class Server(uvicorn.Server):
        """uvicorn re-raises a captured SIGTERM after its graceful shutdown, so the process dies of the
        signal; the shutdown was clean, so take the signals here and return (exit status 0)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    return Server


if __name__ == "__main__":
    main()
