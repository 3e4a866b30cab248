"""The server's and the engine worker's lifetime (issue 37): SIGTERM with open streams, a dead worker,
a ProcessAsyncEngine never closed, and user mistakes on the command line. Real processes throughout.

docs/reliability.md names these tests for what they state.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serve_proc import ServeProcess, free_port

from rollout.models.toy import build_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_checkpoint(tmp_path_factory.mktemp("life") / "m", "qwen3", seed=4))


def _events(lines: list[str]) -> tuple[list[dict], bool]:
    data = [line[6:] for line in lines if line.startswith("data: ")]
    return [json.loads(d) for d in data if d != "[DONE]"], bool(data) and data[-1] == "[DONE]"


def test_sigterm_ends_every_open_stream_with_an_abort_chunk_and_done(model_dir, tmp_path):
    s = ServeProcess(model_dir, "--graceful-shutdown-s", "1", log=tmp_path / "serve.log")
    try:
        assert "(1 server process)" in s.log()  # not "1 server processes"
        # paused in place: the streams stay open, whatever the machine's speed, until the drain ends
        assert httpx.post(s.url + "/pause_generation", json={"mode": "in_place"}).json()["success"]
        bodies = {
            "/v1/completions": {"prompt": "ab", "max_tokens": 500, "stream": True},
            "/v1/chat/completions": {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 500,
                "stream": True,
            },
            "/generate": {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 500}, "stream": True},
        }
        got: dict[str, list[str]] = {}

        def read(path: str) -> None:
            with httpx.stream("POST", s.url + path, json=bodies[path], timeout=60) as r:
                got[path] = list(r.iter_lines())

        threads = [threading.Thread(target=read, args=(p,)) for p in bodies]
        for t in threads:
            t.start()
        time.sleep(1.5)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0, s.log()
        for t in threads:
            t.join(30)
        for path in bodies:
            events, done = _events(got[path])
            assert done and events, (path, got[path])
            last = events[-1]
            reason = (
                last["meta_info"]["finish_reason"]["type"]
                if path == "/generate"
                else last["choices"][0]["finish_reason"]
            )
            assert reason == "abort", (path, last)
    finally:
        s.stop()


def test_a_dead_worker_answers_503_and_the_server_exits_1(model_dir, tmp_path):
    s = ServeProcess(model_dir, log=tmp_path / "serve.log")
    try:
        assert httpx.post(s.url + "/pause_generation", json={"mode": "in_place"}).json()["success"]
        result: dict = {}
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 500}}
        t = threading.Thread(
            target=lambda: result.update(r=httpx.post(s.url + "/generate", json=body, timeout=60))
        )
        t.start()
        time.sleep(1.0)
        os.kill(s.worker_pid(), signal.SIGKILL)
        t.join(60)
        r = result["r"]
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert s.proc.wait(60) == 1, s.log()
        assert "exiting 1" in s.log() and "Traceback" not in s.log()
    finally:
        s.stop()


def test_health_fails_once_the_worker_is_dead(model_dir):
    """The window between the worker's death and the server's exit, held open: the app over a
    ProcessAsyncEngine in this process, its worker killed."""
    import uvicorn

    from rollout import ProcessAsyncEngine
    from rollout.serve import build_app

    engine = ProcessAsyncEngine(model_dir, device="cpu", max_total_tokens=2048, page_size=4)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, model_name="m"), port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health").status_code == 200
        os.kill(engine.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health").status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        r = httpx.post(url + "/generate", json={"input_ids": [5]})
        assert (
            r.status_code == 503 and r.json()["error"]["code"] == "engine_dead" and r.headers["retry-after"]
        )
    finally:
        server.should_exit = True
        thread.join(60)


SCRIPT = """
import sys
from rollout import ProcessAsyncEngine, SamplingParams
import asyncio
engine = ProcessAsyncEngine(sys.argv[1], device="cpu", max_total_tokens=1024, page_size=4)
out = asyncio.run(engine.generate(input_ids=[5, 6], sampling_params=SamplingParams(max_new_tokens=2)))
print("pid", engine.pid, len(out.outputs[0].token_ids), flush=True)
"""  # and no close(): the exit hook stops the worker


def test_a_process_engine_never_closed_stops_its_worker_cleanly(model_dir):
    r = subprocess.run([sys.executable, "-c", SCRIPT, model_dir], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "TypeError" not in r.stderr, r.stderr
    pid = int(r.stdout.split()[1])
    assert not os.path.exists(f"/proc/{pid}")  # reaped, not left behind


@pytest.mark.parametrize(
    "cmd, needle",
    [
        (["-m", "rollout.serve", "--model", "/no/such/folder"], "does not exist"),
        (["-m", "rollout", "/no/such/folder"], "does not exist"),
        (["examples/grpo.py", "--model", "/no/such/folder"], "does not exist"),
        (["examples/grpo.py", "--n", "1"], "n must be >= 2"),
        (["examples/grpo.py", "--task", "chess"], "invalid choice"),
        (["-m", "rollout.serve", "--max-n", "0"], "max_n"),
        (["-m", "rollout", "--device", "cuda"], "CUDA is not available"),
        (["-m", "rollout.serve", "--device", "cuda"], "CUDA is not available"),
    ],
)
def test_user_mistakes_print_one_line_and_exit_2(cmd, needle):
    import torch

    if "cuda" in cmd and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    r = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and needle in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(("python -m", "examples/grpo.py", "grpo.py", "usage"))
    assert len([x for x in r.stderr.splitlines() if "error" in x]) == 1, r.stderr


def test_help_shows_the_defaults():
    r = subprocess.run(
        [sys.executable, "-m", "rollout.serve", "--help"], capture_output=True, text=True, timeout=60
    )
    text = " ".join(r.stdout.split())
    from rollout.config import EngineConfig

    for flag, default in [
        ("--port PORT", 30000),
        ("--host HOST", "127.0.0.1"),
        ("--max-n MAX_N", 64),
        ("--max-total-tokens MAX_TOTAL_TOKENS", EngineConfig.max_total_tokens),
    ]:
        assert f"(default: {default})" in text.split(flag, 2)[2].split(" --", 1)[0], flag
    r = subprocess.run(
        [sys.executable, "examples/grpo.py", "--help"], capture_output=True, text=True, timeout=60
    )
    assert "(default:" in r.stdout
