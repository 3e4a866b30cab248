"""The HTTP server tried as an attacker and a careful user would (issue 37), against real
`python -m rollout.serve` processes: one with default flags ("open") and one with --api-key and the
pickle opt-in ("keyed"), each shared by the module.

docs/security.md and docs/reliability.md name these tests for what they state.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import threading
import time

import httpx
import pytest
import torch
from serve_proc import ServeProcess

from rollout.models.toy import CHAT_TEMPLATE, build_checkpoint
from rollout.serve.tensor_wire import encode_safetensors

pytestmark = pytest.mark.slow

KEY = "k3y-for-tests"
# the toy template, refusing a role as real templates do (jinja2's raise_exception)
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    "{% endfor %}" + CHAT_TEMPLATE
)


class Probe:
    """A pickle that creates `marker` when unpickled: proof that the server ran the sender's code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _probe(marker) -> str:
    return base64.b64encode(pickle.dumps([("model.norm.weight", Probe(str(marker)))])).decode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_checkpoint(tmp_path_factory.mktemp("hard") / "m", "qwen3", seed=4))


@pytest.fixture(scope="module")
def strict_dir(tmp_path_factory):
    folder = build_checkpoint(tmp_path_factory.mktemp("hard") / "strict", "qwen3", seed=4)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": STRICT_TEMPLATE}))
    (folder / "chat_template.jinja").write_text(STRICT_TEMPLATE)
    return str(folder)


@pytest.fixture(scope="module")
def open_server(model_dir, tmp_path_factory):
    flags = [
        "--max-body-bytes",
        "4000000",
        "--max-n",
        "8",
        "--max-request-tokens",
        "3000",
        "--served-model-name",
        "toy",
    ]
    s = ServeProcess(model_dir, *flags, log=tmp_path_factory.mktemp("log") / "open.log")
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def keyed_server(strict_dir, tmp_path_factory):
    flags = ["--api-key", KEY, "--allow-pickle-weight-updates-unsafe", "--allowed-hosts", "trainer.internal"]
    s = ServeProcess(strict_dir, *flags, log=tmp_path_factory.mktemp("log") / "keyed.log")
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture
def oc(open_server):
    with httpx.Client(base_url=open_server.url, timeout=120) as c:
        yield c


@pytest.fixture
def kc(keyed_server):
    with httpx.Client(
        base_url=keyed_server.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}
    ) as c:
        yield c


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    """The response is `status` with OpenAI's error shape (and names `param` when given)."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


SP = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


# -- 1. security -----------------------------------------------------------------------------------
def test_pickle_over_http_is_refused_by_default_and_runs_no_code(oc, tmp_path):
    marker = tmp_path / "pwned"
    for extra in ({}, {"format": "pickle"}):
        r = oc.post(
            "/update_weights_from_tensor", json={"serialized_named_tensors": [_probe(marker)]} | extra
        )
        e = _error(r, 400)
        assert "--allow-pickle-weight-updates-unsafe" in e["message"]
        assert not marker.exists()  # no code of the sender's ran
    assert oc.post("/generate", json={"input_ids": [5, 6], "sampling_params": SP}).status_code == 200


def test_pickle_opt_in_still_needs_the_key_and_then_works(keyed_server, kc, tmp_path, model_dir):
    marker = tmp_path / "pwned"
    r = httpx.post(
        keyed_server.url + "/update_weights_from_tensor", json={"serialized_named_tensors": [_probe(marker)]}
    )
    _error(r, 401)
    assert not marker.exists()
    from safetensors.torch import load_file

    w = load_file(os.path.join(model_dir, "model.safetensors"))["model.norm.weight"]
    blob = base64.b64encode(pickle.dumps([("model.norm.weight", w)])).decode()
    r = kc.post("/update_weights_from_tensor", json={"serialized_named_tensors": [blob]})
    assert r.status_code == 200 and r.json()["success"], r.text


def test_pickle_opt_in_without_a_key_is_a_usage_error(model_dir):
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "rollout.serve",
        "--model",
        model_dir,
        "--allow-pickle-weight-updates-unsafe",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--api-key" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_safetensors_update_over_http_changes_the_weights_and_bad_bytes_are_400(oc, open_server, model_dir):
    from safetensors.torch import load_file

    norm = load_file(os.path.join(model_dir, "model.safetensors"))["model.norm.weight"]
    greedy = {"input_ids": [5, 6, 7], "sampling_params": SP | {"max_new_tokens": 6}}
    before = oc.post("/generate", json=greedy).json()["output_ids"]
    version = oc.get("/get_weight_version").json()["weight_version"]
    zero = encode_safetensors([("model.norm.weight", torch.zeros_like(norm))])
    r = oc.post("/update_weights_from_tensor", json={"serialized_named_tensors": [zero]})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert oc.get("/get_weight_version").json()["weight_version"] != version
    assert oc.post("/generate", json=greedy).json()["output_ids"] == [0] * 6  # all logits 0: token 0
    from integrations.http_weights import post_weights

    assert post_weights(open_server.url, [("model.norm.weight", norm)]).startswith("ok")  # the trainer's way
    assert oc.post("/generate", json=greedy).json()["output_ids"] == before
    for junk in ("bm90IHNhZmV0ZW5zb3Jz", "%%%"):
        _error(oc.post("/update_weights_from_tensor", json={"serialized_named_tensors": [junk]}), 400)
    for junk in ("{not json", '[{"name": 5}]'):
        body = {"serialized_named_tensors": [junk], "format": "cuda_ipc"}
        _error(oc.post("/update_weights_from_tensor", json=body), 400)


def test_host_header_must_name_the_server(open_server, keyed_server):
    port = open_server.port
    for host, ok in [
        ("attacker.example", False),
        (f"attacker.example:{port}", False),
        (f"127.0.0.1:{port}", True),
        (f"localhost:{port}", True),
        ("localhost", True),
    ]:
        r = httpx.get(open_server.url + "/v1/models", headers={"Host": host})
        if ok:
            assert r.status_code == 200, (host, r.text)
        else:
            _error(r, 400, "host")
    headers = {"Authorization": f"Bearer {KEY}"}
    assert (
        httpx.get(keyed_server.url + "/v1/models", headers=headers | {"Host": "trainer.internal"}).status_code
        == 200
    )
    _error(
        httpx.get(keyed_server.url + "/v1/models", headers=headers | {"Host": "other.internal"}), 400, "host"
    )


def test_401s_are_openai_shaped_and_the_schema_pages_are_off_with_a_key(keyed_server, open_server):
    e = _error(httpx.get(keyed_server.url + "/v1/models"), 401)
    assert e["type"] == "authentication_error"
    _error(httpx.get(keyed_server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}x"}), 401)
    for page in ("/docs", "/redoc", "/openapi.json"):
        _error(httpx.get(keyed_server.url + page, headers={"Authorization": f"Bearer {KEY}"}), 404)
        assert httpx.get(open_server.url + page).status_code == 200  # no key: nothing to protect
    assert httpx.get(keyed_server.url + "/health").status_code == 200


def test_api_key_is_compared_in_constant_time(monkeypatch):
    import asyncio

    from rollout.serve import guard

    calls = []
    real = guard.hmac.compare_digest
    monkeypatch.setattr(guard.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    check = guard.api_key_check("s3cret")

    class Req:
        headers = {"authorization": "Bearer s3cret"}

    asyncio.run(check(Req()))
    Req.headers = {"authorization": "Bearer s3creX"}
    with pytest.raises(guard.ApiError):
        asyncio.run(check(Req()))
    assert calls == [(b"Bearer s3cret", b"Bearer s3cret"), (b"Bearer s3creX", b"Bearer s3cret")]


def test_body_size_is_capped(oc, open_server):
    big = {"input_ids": [5] * 900_000, "sampling_params": SP}  # ~2.7 MB of JSON... over 4 MB with spaces
    payload = json.dumps(big).encode() + b" " * 2_000_000
    _error(oc.post("/generate", content=payload, headers={"content-type": "application/json"}), 413)

    def chunks():  # no Content-Length: the cap is counted while reading
        for _ in range(50):
            yield b" " * 100_000

    _error(oc.post("/generate", content=chunks(), headers={"content-type": "application/json"}), 413)
    assert oc.post("/generate", json={"input_ids": [5, 6], "sampling_params": SP}).status_code == 200


# -- 2. bounds -------------------------------------------------------------------------------------
def test_per_request_bounds_are_400_before_any_work(oc):
    t0 = time.monotonic()
    _error(oc.post("/v1/completions", json={"prompt": [5, 6], "n": 10**6, "max_tokens": 2}), 400, "n")
    _error(oc.post("/v1/completions", json={"prompt": [5, 6], "n": 2, "best_of": 10**6}), 400, "best_of")
    _error(oc.post("/v1/completions", json={"prompt": [5, 6], "n": 2, "best_of": 4}), 400, "best_of")
    _error(oc.post("/v1/completions", json={"prompt": [5, 6], "logprobs": 21}), 400, "logprobs")
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    _error(
        oc.post("/v1/chat/completions", json=chat | {"logprobs": True, "top_logprobs": 50}),
        400,
        "top_logprobs",
    )
    _error(
        oc.post("/generate", json={"input_ids": [5], "sampling_params": {"n": 9}}), 400, "sampling_params.n"
    )
    _error(oc.post("/generate", json={"input_ids": [5], "top_logprobs_num": 10**6}), 400, "top_logprobs_num")
    e = _error(oc.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1023}), 400, "max_tokens")
    assert "context" in e["message"]
    e = _error(
        oc.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 500, "n": 8}), 400, "max_tokens"
    )
    assert "--max-request-tokens" in e["message"]
    e = _error(oc.post("/v1/completions", json={"prompt": [[5]] * 300, "max_tokens": 1}), 400, "prompt")
    assert time.monotonic() - t0 < 30
    assert oc.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "n": 8}).status_code == 200


# -- 3. engine states ------------------------------------------------------------------------------
def test_released_memory_is_503_with_retry_after_then_serves_again(oc):
    assert oc.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).json()["success"]
    try:
        for path, body in [
            ("/generate", {"input_ids": [5, 6], "sampling_params": SP}),
            ("/v1/completions", {"prompt": "ab", "max_tokens": 2}),
        ]:
            r = oc.post(path, json=body)
            e = _error(r, 503)
            assert r.headers["retry-after"] and "released" in e["message"]
    finally:
        assert oc.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).json()["success"]
    assert oc.post("/generate", json={"input_ids": [5, 6], "sampling_params": SP}).status_code == 200


def test_pause_retract_then_disk_update_then_continue_serves(oc, model_dir):
    result: dict = {}
    body = {"input_ids": [5, 6], "sampling_params": SP | {"max_new_tokens": 40}}
    t = threading.Thread(target=lambda: result.update(r=oc.post("/generate", json=body)))
    t.start()
    time.sleep(0.3)
    assert oc.post("/pause_generation", json={"mode": "retract"}).json()["success"]
    r = oc.post("/update_weights_from_disk", json={"model_path": model_dir})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert oc.post("/continue_generation", json={}).json()["success"]
    t.join(120)
    assert result["r"].status_code == 200, result["r"].text


# -- 5. the event loop -----------------------------------------------------------------------------
def test_a_long_prompt_is_tokenised_off_the_event_loop(oc, open_server):
    result: dict = {}
    text = "ab 12 " * 60_000  # 360k characters: seconds of tokenising on a loaded 2-core machine
    t = threading.Thread(target=lambda: result.update(r=oc.post("/v1/completions", json={"prompt": text})))
    t.start()
    time.sleep(0.2)
    worst = 0.0
    while t.is_alive():
        t0 = time.monotonic()
        assert httpx.get(open_server.url + "/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    t.join()
    _error(result["r"], 400, "max_tokens")  # 360k tokens exceed the context: refused after tokenising
    assert worst < 1.0, worst


# -- 6. disconnects --------------------------------------------------------------------------------
def test_a_non_streamed_generate_whose_client_left_is_aborted(oc, open_server):
    assert oc.post("/pause_generation", json={"mode": "in_place"}).json()["success"]  # it cannot finish
    try:
        body = {"input_ids": [5, 6], "sampling_params": SP | {"max_new_tokens": 500}, "rid": "left"}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(open_server.url + "/generate", json=body, timeout=1.5)
        deadline = time.monotonic() + 10
        while oc.post("/abort_request", json={"rid": "left"}).json()["success"]:
            assert time.monotonic() < deadline, "the request of the client that left is still in flight"
            time.sleep(0.2)
    finally:
        assert oc.post("/continue_generation", json={}).json()["success"]


# -- 7. inputs -------------------------------------------------------------------------------------
def test_inputs_are_strict_and_errors_name_the_clients_field(oc):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    _error(oc.post("/v1/chat/completions", json=chat | {"max_tokens": 0}), 400, "max_tokens")
    _error(
        oc.post("/v1/chat/completions", json=chat | {"max_completion_tokens": 0}),
        400,
        "max_completion_tokens",
    )
    _error(oc.post("/generate", json={"input_ids": []}), 400, "input_ids")
    _error(oc.post("/generate", json={"text": []}), 400, "text")
    _error(oc.post("/generate", json={"text": ""}), 400, "text")
    _error(oc.post("/v1/completions", json={"prompt": []}), 400, "prompt")
    _error(oc.post("/v1/completions", json={"prompt": [5], "max_tokens": "4"}), 400, "max_tokens")
    _error(oc.post("/generate", json={"input_ids": [5], "sampling_params": {"ignore_eos": "no"}}), 400)
    for ids in ([True, 5], [5.0, 6.0], ["5", 6]):
        _error(oc.post("/generate", json={"input_ids": ids}), 400, "input_ids")
        _error(oc.post("/v1/completions", json={"prompt": ids}), 400, "prompt")
    e = _error(oc.post("/v1/completions", json={"prompt": [5], "model": "gpt-4"}), 404, "model")
    assert e["code"] == "model_not_found"
    _error(oc.post("/v1/chat/completions", json=chat | {"model": "gpt-4"}), 404, "model")
    e = _error(oc.post("/v1/completions", json={"prompt": [5], "max_tokens": -1}), 400, "max_tokens")
    assert "SamplingParams" not in e["message"] and "max_new_tokens" not in e["message"]
    e = _error(oc.post("/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": -1}}), 400)
    assert e["param"] == "sampling_params.max_new_tokens"
    r = oc.post("/v1/completions", json={"prompt": [5], "model": "toy", "max_tokens": 2})
    assert r.status_code == 200


def test_a_template_that_refuses_the_messages_is_400(kc):
    msgs = [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}]
    e = _error(kc.post("/v1/chat/completions", json={"messages": msgs}), 400, "messages")
    assert "no system role" in e["message"]
    r = kc.post("/v1/chat/completions", json={"messages": msgs[:1], "max_tokens": 2})
    assert r.status_code == 200, r.text


# -- 9. small things a newcomer met ----------------------------------------------------------------
def test_the_toy_model_chats_and_text_offset_is_filled(oc):
    import openai

    client = openai.OpenAI(base_url=oc.base_url.join("/v1").__str__(), api_key="none")
    r = client.chat.completions.create(
        model="toy", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert r.choices[0].finish_reason in ("length", "stop")
    r = client.completions.create(
        model="toy", prompt="ab", max_tokens=5, logprobs=1, extra_body={"ignore_eos": True}
    )
    lp = r.choices[0].logprobs
    assert len(lp.text_offset) == 5 and lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


@pytest.mark.gpu
def test_gpu_cuda_ipc_update_over_http_changes_the_weights(model_dir, tmp_path):
    """format="cuda_ipc": the trainer's CUDA tensors cross as handle fields in JSON (no pickle, no copy
    through the host) and the served weights change; then the original ones go back the same way."""
    from safetensors.torch import load_file

    from integrations.http_weights import post_weights

    s = ServeProcess(model_dir, "--device", "cuda", "--no-cuda-graph", log=tmp_path / "gpu.log")
    try:
        norm = load_file(os.path.join(model_dir, "model.safetensors"))["model.norm.weight"].cuda()
        greedy = {"input_ids": [5, 6, 7], "sampling_params": SP | {"max_new_tokens": 6}}
        before = httpx.post(s.url + "/generate", json=greedy, timeout=120).json()["output_ids"]
        zero = torch.zeros_like(norm)
        post_weights(s.url, [("model.norm.weight", zero)], format="cuda_ipc")
        assert httpx.post(s.url + "/generate", json=greedy, timeout=120).json()["output_ids"] == [0] * 6
        post_weights(s.url, [("model.norm.weight", norm)], format="cuda_ipc")
        assert httpx.post(s.url + "/generate", json=greedy, timeout=120).json()["output_ids"] == before
    finally:
        assert s.stop() == 0, s.log()
