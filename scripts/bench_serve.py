"""Serving throughput (GPU): the HTTP server with CUDA graphs under 256 concurrent streaming clients,
beside the same workload through Engine.generate; prints output tok/s and the ratios in one run.

The workload: 256 requests with random prompt tokens, input lengths 100-1024 and output lengths 100-512
(fixed seed), temperature 0.6, ignore_eos. Each client streams its request over SSE (/generate with
stream=true with --endpoint generate; by default /v1/completions deltas) from a separate
process on 127.0.0.1 and counts the tokens it receives. With --requests above --clients, each client
streams its requests one after another, and both phases run --clients requests at a time (the
engine's max_running_requests): a steady load, where the start and the tail weigh less.

Serving modes (--mode, default both):
- thread: AsyncEngine, the step loop in a thread of the server's process (the engine Engine.generate
  just ran, one KV pool, one set of graphs);
- process: ProcessAsyncEngine, the engine in a child process of the server (as `python -m rollout.serve`
  runs it by default).
Each phase runs in a process of its own, so two engines never hold the device at once.

    python scripts/bench_serve.py --model qwen2.5-0.5b          # random checkpoint, real shapes
    python scripts/bench_serve.py --model path/to/hf/ckpt --clients 256 --mode process
    python scripts/bench_serve.py --model tiny --device cpu --requests 16 --clients 16 --max-input 200 \
        --max-output 64   # dry run (on a small CPU set OMP_NUM_THREADS=1: the processes share its cores)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import SHAPES, model_folder  # noqa: E402
from timeline import Timeline  # noqa: E402

from rollout import AsyncEngine, Engine, ProcessAsyncEngine, SamplingParams  # noqa: E402
from rollout.models.config import ModelConfig  # noqa: E402
from rollout.process.child import freeze_heap  # noqa: E402


def workload(vocab: int, seed: int, num: int, max_in: int, max_out: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(min(100, max_in), max_in))] for _ in range(num)
    ]
    return prompts, [rng.randint(min(100, max_out), max_out) for _ in range(num)]


def params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.6, max_new_tokens=n, ignore_eos=True)


def run_engine(
    engine: Engine, prompts: list[list[int]], outs: list[int], repeats: int, timeline: bool = False
) -> float:
    """Output tok/s of Engine.generate over the workload, the best of `repeats` runs (each from an
    empty prefix cache); with `timeline`, the engine's progress over each run too."""
    engine.generate(input_ids=prompts[:4], sampling_params=[params(8)] * 4, use_tqdm=False)  # warm-up
    best = 0.0
    for _ in range(repeats):
        engine.flush_cache()
        t0, graphs = time.perf_counter(), engine.stats.graph_steps
        with Timeline(lambda: engine.stats) if timeline else nullcontext() as line:
            done = engine.generate(
                input_ids=prompts, sampling_params=[params(n) for n in outs], use_tqdm=False
            )
        seconds = time.perf_counter() - t0
        s = engine.last_stats
        print(
            f"Engine.generate: {seconds:.3f} s; {steps_line(s, seconds)}; "
            f"{engine.stats.graph_steps - graphs} graph steps",
            flush=True,
        )
        if line is not None:
            print(line.table(), flush=True)
        best = max(best, sum(len(o.outputs[0].token_ids) for o in done) / seconds)
    return best


def steps_line(s: dict, seconds: float) -> str:
    """The engine's steps over a run: a served run with more steps, or slower ones, than Engine.generate
    shows where the time went (admission spread out, slower steps, or time between the steps)."""
    per, decode_steps = max(s["steps"], 1), max(s["steps"] - s["prefill_steps"], 1)
    return (
        f"{s['steps']} steps ({s['prefill_steps']} prefill), {s['decode_tokens'] / decode_steps:.1f} "
        f"tokens a decode step, {seconds / per * 1e3:.2f} ms a step; {s['step_seconds']:.3f} s inside "
        f"the steps ({s['step_seconds'] / per * 1e3:.2f} ms a step)"
    )


def serve(front: object, api_servers: int = 1) -> tuple[str, object, list]:
    """The app over `front` (an AsyncEngine or a ProcessAsyncEngine), served by uvicorn in a thread, and
    with api_servers > 1 by that many server processes in all over the same engine process and socket
    (`python -m rollout.serve --api-server-count N`). Returns the URL, the server and the other
    processes."""
    import uvicorn

    from rollout.serve import build_app
    from rollout.serve import processes as P

    sock = P.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    fronts = []
    if api_servers > 1:
        settings = P.ServeSettings("bench", None, None, 30.0, front.stream_interval)
        fronts = P.start_fronts(api_servers - 1, *front.listen(), sock, settings)
    app = build_app(front, model_name="bench")
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", backlog=4096))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    # uvicorn's "auto" picks httptools and uvloop when installed (the serve extra): say which it took
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    print(f"uvicorn: {server.config.http_protocol_class.__name__}, event loop from {loop}", flush=True)
    print(f"server processes: {api_servers}", flush=True)
    return f"http://127.0.0.1:{port}", server, fronts


def server_cpu(pids: list[int]) -> list[float]:
    """User + system CPU seconds so far of this process, then of each of `pids` (Linux /proc)."""
    tick, found = os.sysconf("SC_CLK_TCK"), [time.process_time()]
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        found.append((int(fields[11]) + int(fields[12])) / tick)
    return found


def stop(server: object, fronts: list) -> None:
    import signal

    from rollout.serve import processes as P

    for p in fronts:
        os.kill(p.pid, signal.SIGTERM)
    P.stop_fronts(fronts, 60)
    server.should_exit = True


async def run_clients(
    url: str, prompts: list[list[int]], outs: list[int], clients: int, endpoint: str, warm=None
) -> tuple[int, float, float, list, list, list]:
    """Stream every request, `clients` at a time; (tokens received, start, end, and per request when its
    first token came, when it ended and when its response headers came) on the monotonic clock,
    the start after a warm-up request and, with `warm`, once `warm()` has returned."""
    import httpx

    gate = asyncio.Semaphore(clients)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def one(ac: httpx.AsyncClient, ids: list[int], n: int) -> tuple[int, float | None, float, float]:
        if endpoint == "completions":  # OpenAI-style deltas; token ids counted chunk by chunk
            path = "/v1/completions"
            body = dict(prompt=ids, max_tokens=n, temperature=0.6, ignore_eos=True, stream=True)
            body["return_token_ids"] = True
        else:  # SGLang's /generate: each chunk holds the output so far
            path = "/generate"
            sp = {"max_new_tokens": n, "temperature": 0.6, "ignore_eos": True}
            body = {"input_ids": ids, "sampling_params": sp, "stream": True}
        async with gate, ac.stream("POST", path, json=body) as r:
            r.raise_for_status()
            count, first, heard = 0, None, time.monotonic()  # headers: the server took the request
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if endpoint == "completions":
                    count += len(chunk["choices"][0]["token_ids"])
                else:
                    count = chunk["meta_info"]["completion_tokens"]
                first = first or (time.monotonic() if count else None)
            return count, first, time.monotonic(), heard

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as ac:
        await one(ac, prompts[0][:32][::-1], 8)  # warm-up, with a prompt that leaves no cached prefix
        if warm is not None:
            warm()
        t0 = time.monotonic()
        done = await asyncio.gather(*(one(ac, p, n) for p, n in zip(prompts, outs)))
        t1 = time.monotonic()
    if [d[0] for d in done] != outs:
        raise RuntimeError("a streamed request came back short")
    return sum(outs), t0, t1, [d[1] for d in done], [d[2] for d in done], [d[3] for d in done]


def clients_process(
    url: str, prompts: list, outs: list, clients: int, endpoint: str, cores: set | None, ready, go, result
) -> None:
    """Clients in a process of their own, as real clients are: they share no interpreter lock with the
    server (nor, with --client-procs > 1, with each other). Their heap, torch's modules imported with
    this script, is frozen as the server's is: a real client's is small, and its full collections would
    pause the streams."""
    pin(cores)
    freeze_heap()

    def warm() -> None:  # tell the parent, then start with every other client process
        ready.put(None)
        go.wait(900)

    result.put(asyncio.run(run_clients(url, prompts, outs, clients, endpoint, warm)))


def run_clients_elsewhere(
    url: str,
    prompts: list,
    outs: list,
    clients: int,
    endpoint: str,
    procs: int = 1,
    cores: set | None = None,
    at_start: Callable[[], Any] | None = None,
) -> tuple[float, float, Any]:
    """Output tok/s of the requests streamed by `procs` client processes (request i in process i mod
    procs, `clients` concurrent streams in all; on `cores` when given), from the first start to the
    last end; that start (monotonic clock); and what `at_start` returned. It runs here once every client
    process has warmed up, before they start (the engine is idle then: its counts from there on are the
    run's)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready, go, result = ctx.Queue(), ctx.Event(), ctx.Queue()
    workers = []
    for i in range(procs):
        share = (prompts[i::procs], outs[i::procs], max(1, clients // procs), endpoint, cores)
        workers.append(ctx.Process(target=clients_process, args=(url, *share, ready, go, result)))
    for w in workers:
        w.start()
    try:
        wait_results(workers, ready, 600)  # every client warmed up (a failed one fails the run here)
        marked = at_start() if at_start is not None else None
        go.set()
        found = wait_results(workers, result, 1800)
    finally:
        for w in workers:
            w.join(10)
    tokens, start = sum(f[0] for f in found), min(f[1] for f in found)
    # when the server took the requests (response headers), when they got going and when they ended, from
    # the first start (monotonic clock, shared by the host): late headers mean slow admission
    named = (("headers", 5), ("first tokens", 3), ("ends", 4))
    print(", ".join(f"{n}: {spread([t - start for f in found for t in f[i]])}" for n, i in named), flush=True)
    return tokens / (max(f[2] for f in found) - start), start, marked


def split_cores(client_cores: int) -> tuple[set[int] | None, set[int] | None]:
    """(engine cores, client cores): with client_cores > 0, the client processes get the last
    `client_cores` cores this process may use and the engine phases the others. Real clients run on
    other machines; on one host, clients on the engine's cores would slow its host-bound step."""
    if client_cores <= 0:
        return None, None
    cores = sorted(os.sched_getaffinity(0))
    if client_cores >= len(cores):
        raise SystemExit(
            f"--client-cores {client_cores}: this process has {len(cores)} cores; leave the engine one"
        )
    return set(cores[:-client_cores]), set(cores[-client_cores:])


def pin(cores: set[int] | None) -> None:
    """Keep this process (and the processes it starts after) on `cores`, with no more CPU threads for
    torch than that (torch, imported before, counted the host's)."""
    if cores:
        import torch

        os.sched_setaffinity(0, cores)
        torch.set_num_threads(min(torch.get_num_threads(), len(cores)))


def spread(times: list[float]) -> str:
    times = sorted(times)
    return f"median {times[len(times) // 2]:.3f} s, last {times[-1]:.3f} s"


def engine_options(args: argparse.Namespace) -> dict:
    return dict(
        device=args.device,
        cuda_graph=bool(args.cuda_graph),
        # Engine.generate runs as many requests at once as the served run's clients do (with --requests
        # above --clients, both run --clients at a time)
        max_running_requests=args.clients,
        mixed_chunk=bool(args.mixed_chunk),
    )


def thread_phase(folder: Path, args: argparse.Namespace, prompts: list, outs: list, result) -> None:
    """Engine.generate, then (with --mode thread or both) the same engine served by AsyncEngine."""
    pin(args.engine_cores)
    engine = Engine(folder, **engine_options(args))
    freeze_heap()  # as the server's processes do: Engine.generate gets no full collections of start-up either
    found = {"engine_generate_tok_s": run_engine(engine, prompts, outs, args.repeats, args.timeline)}
    if args.mode in ("thread", "both"):
        engine.flush_cache()  # the served run computes its prompts too
        url, server, _ = serve(AsyncEngine.from_engine(engine, stream_interval=args.stream_interval))
        found["thread_stream_tok_s"], _, _ = run_clients_elsewhere(
            url, prompts, outs, args.clients, args.endpoint, args.client_procs, args.client_cores
        )
        server.should_exit = True
    result.put(found)


def process_phase(folder: Path, args: argparse.Namespace, prompts: list, outs: list, result) -> None:
    """The server over ProcessAsyncEngine: the engine in a child of this (the server's) process."""
    pin(args.engine_cores)  # the engine's process and the other server processes start on them too
    front = ProcessAsyncEngine(folder, stream_interval=args.stream_interval, **engine_options(args))
    try:
        url, server, fronts = serve(front, args.api_servers)
    except BaseException:
        front.close()  # else the engine's child keeps this process from exiting, and the run waits
        raise
    pids = [p.pid for p in fronts]
    best: dict = {}
    for _ in range(args.repeats):
        asyncio.run(front.flush_cache())  # every run computes its prompts, as Engine.generate's do
        with Timeline(lambda: front.stats) if args.timeline else nullcontext() as line:
            # the engine's counts and the server processes' CPU, read as the clients start
            served, start, (before, cpu0) = run_clients_elsewhere(
                url,
                prompts,
                outs,
                args.clients,
                args.endpoint,
                args.client_procs,
                args.client_cores,
                at_start=lambda: (front.stats, server_cpu(pids)),
            )
        # the server processes' own CPU time (their threads, not the engine's process nor the clients'):
        # the cost of serving a token, whatever the device; near 1 s a second each (over the streams'
        # span, the clients' start-up left out), they are the limit
        each = [t - t0 for t, t0 in zip(server_cpu(pids), cpu0)]
        after, wall = front.stats, sum(outs) / served
        keys = ("steps", "prefill_steps", "decode_tokens", "step_seconds")
        delta = {k: getattr(after, k) - getattr(before, k) for k in keys}
        graphs = after.graph_steps - before.graph_steps
        print(f"served: {steps_line(delta, wall)}; {graphs} graph steps", flush=True)
        if line is not None:  # from the clients' start, as the headers and first tokens above
            print(line.table(start, before), flush=True)
        # one busy process among idle ones means the connections were not shared out evenly
        print("server processes' CPU s: " + ", ".join(f"{t:.2f}" for t in each), flush=True)
        if served > best.get("process_stream_tok_s", 0.0):
            best = {
                "process_stream_tok_s": served,
                "server_cpu_us_per_token": sum(each) / sum(outs) * 1e6,
                "server_cpu_s_per_s": sum(each) / wall / args.api_servers,
            }  # fmt: skip
    stop(server, fronts)  # the first server's lifespan shuts the engine process down
    result.put(best)


def in_own_process(phase, *args) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    proc = ctx.Process(target=phase, args=(*args, result))
    proc.start()
    try:
        return wait_results([proc], result, 3600)[0]
    finally:
        proc.join(60)


def wait_results(procs: list, result, timeout: float) -> list:
    """One value from each of `procs` off `result`, in any order. A process that fails (or all ending
    with values missing) fails the run at once instead of leaving it waiting for the whole timeout."""
    import queue

    found, deadline = [], time.monotonic() + timeout
    while len(found) < len(procs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(procs) - len(found)} of {len(procs)} processes gave no result")
        try:
            found.append(result.get(timeout=1))
            continue
        except queue.Empty:
            pass
        failed = any(not p.is_alive() and p.exitcode != 0 for p in procs)
        if failed or not any(p.is_alive() for p in procs):
            try:  # a value put just before the exit
                found.append(result.get(timeout=1))
                continue
            except queue.Empty:
                codes = ", ".join(f"{p.name}: {p.exitcode}" for p in procs)
                raise RuntimeError(f"processes exited with results missing (exit codes {codes})") from None
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="qwen2.5-0.5b", help=f"a checkpoint folder, 'tiny', or one of {sorted(SHAPES)}"
    )
    ap.add_argument("--mode", choices=["thread", "process", "both"], default="both", help="serving modes")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--clients", type=int, default=256, help="concurrent streaming clients")
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cuda-graph", type=int, default=1)
    ap.add_argument("--mixed-chunk", type=int, default=1, help="0: prefill steps carry no decoding rows")
    ap.add_argument("--endpoint", choices=["completions", "generate"], default="completions")
    ap.add_argument(
        "--client-procs", type=int, default=1, help="client processes sharing the --clients streams"
    )
    ap.add_argument(
        "--api-servers", type=int, default=1, help="server processes over the engine (process mode)"
    )
    ap.add_argument("--stream-interval", type=int, default=1, help="the servers' chunk each N tokens")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each phase; the best of each is compared")
    ap.add_argument(
        "--client-cores",
        type=int,
        default=0,
        help="run the client processes on this many cores of their own, the engine phases on the rest",
    )
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="print each run's steps, running and waiting requests over time",
    )
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    args.engine_cores, args.client_cores = split_cores(args.client_cores)
    missing = [m for m in ("uvicorn", "fastapi", "httpx") if importlib.util.find_spec(m) is None]
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if missing:
        ap.error(f"{', '.join(missing)} not installed: pip install 'rollout[serve]' httpx")
    folder = model_folder(args.model)
    mc = ModelConfig.from_path(folder)
    max_in = min(args.max_input, mc.max_position_embeddings - args.max_output)
    prompts, outs = workload(mc.vocab_size, args.seed, args.requests, max_in, args.max_output)
    result = {
        "model": str(args.model),
        "device": args.device,
        "requests": args.requests,
        "clients": args.clients,
        "client_procs": args.client_procs,
        "api_servers": args.api_servers,
        "stream_interval": args.stream_interval,
        "mixed_chunk": bool(args.mixed_chunk),
        "endpoint": args.endpoint,
        "client_cores": len(args.client_cores or ()),
    }
    result |= in_own_process(thread_phase, folder, args, prompts, outs)
    if args.mode in ("process", "both"):
        result |= in_own_process(process_phase, folder, args, prompts, outs)
    direct = result["engine_generate_tok_s"]
    for mode in ("thread", "process"):
        if f"{mode}_stream_tok_s" in result:
            served = result[f"{mode}_stream_tok_s"]
            ratio = served / direct
            result[f"{mode}_ratio"] = round(ratio, 3)
            print(f"{mode} server / Engine.generate output tok/s: {served:.0f} / {direct:.0f} = {ratio:.3f}")
    if "server_cpu_us_per_token" in result:
        print(f"server process CPU: {result['server_cpu_us_per_token']:.1f} us a token, "
              f"{result['server_cpu_s_per_s']:.2f} s a second per server process")  # fmt: skip
    result = {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
