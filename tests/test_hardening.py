"""Issue 12, "never silently wrong, never a hang": each fault below once gave wrong output, a late
error that did not name its cause, or a half-applied update. Each test shows the fault is now refused
up front (naming the field, file or tensor) or cannot change the output, and that the engine stays
usable. GPU tests (marker `gpu`) cover the GPU-only paths."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from dist_cluster import Cluster
from helpers import PROMPTS
from safetensors.torch import load_file, save_file
from weights_helpers import CPU, assert_same_snapshot, load_hf, outputs, perturbed, snapshot, state_list

from rollout import Engine, SamplingParams
from rollout.engine import inputs as requests
from rollout.runner.sampler import SamplingBatch, sample
from rollout.weights import loader
from rollout.weights.broadcast import free_port
from rollout.weights.bucket import FlattenedBucket, TensorMeta, pack, parse_dtype

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    return Engine(qwen3_dir, max_total_tokens=1024, **CPU)


@pytest.fixture(scope="module")
def trainer(qwen3_dir):
    return perturbed(qwen3_dir, seed=12)


@pytest.fixture
def intact(engine, qwen3_dir):
    """Asserts, after the test body, that the engine's weights and outputs are what they were."""
    engine.update_weights_from_disk(qwen3_dir)  # a known state whatever ran before
    version = engine.weight_version
    before, before_out = snapshot(engine, load_hf(qwen3_dir)), outputs(engine)
    yield
    assert engine.weight_version == version, "a refused update must not count as one"
    assert_same_snapshot(engine, before)
    tokens, logprobs = outputs(engine)  # a cached prefix may round differently: logprobs to 1e-5
    assert tokens == before_out[0]
    assert max(abs(a - b) for x, y in zip(logprobs, before_out[1]) for a, b in zip(x, y)) < 1e-5
    assert not engine.scheduler.has_work()


# -- 1. stale KV pages and non-finite weights --------------------------------------------------------
MIXED = [
    SamplingParams(temperature=0, max_new_tokens=9, ignore_eos=True, logprobs=True),
    SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=3, max_new_tokens=7, ignore_eos=True, logprobs=True),
]


def completions(engine, prompts=PROMPTS, params=MIXED) -> list[tuple]:
    ps = [params[i % len(params)] for i in range(len(prompts))]
    outs = engine.generate(input_ids=prompts, sampling_params=ps)
    return [(tuple(c.token_ids), tuple(c.logprobs)) for o in outs for c in o.outputs]


def test_stale_nan_in_the_kv_pool_never_reaches_outputs(engine):
    """Every slot no running request has written holds NaN: each request reads only its own slots
    (pages past its length, slots past its length inside its last page are stale)."""
    clean = completions(engine)
    engine.flush_cache()
    engine.kv.data.fill_(NAN)
    assert completions(engine) == clean
    engine.flush_cache()  # cached prefixes are live data, not stale
    engine.kv.data.fill_(INF)
    assert completions(engine) == clean


no_flashinfer = pytest.mark.skipif(not importlib.util.find_spec("flashinfer"), reason="no flashinfer")
GPU_BACKENDS = [
    ("torch", False),
    ("triton", False),
    ("triton", True),
    pytest.param("flashinfer", False, marks=no_flashinfer),
    pytest.param("flashinfer", True, marks=no_flashinfer),
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend, graphs", GPU_BACKENDS)
def test_stale_nan_in_the_kv_pool_never_reaches_outputs_gpu(tmp_path, backend, graphs):
    from rollout.models.toy import build_checkpoint

    path = build_checkpoint(
        tmp_path / "q", "qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, seed=4,
    )  # fmt: skip
    engine = Engine(
        str(path), device="cuda", dtype="bfloat16", attention_backend=backend, cuda_graph=graphs,
        page_size=16, max_total_tokens=8192, max_running_requests=16,
    )  # fmt: skip
    prompts = [[3 + i % 70 for i in range(n)] for n in (1, 15, 16, 17, 40, 100)]
    clean = completions(engine, prompts)
    engine.flush_cache()
    engine.kv.data.fill_(NAN)
    assert completions(engine, prompts) == clean
    assert not any(math.isnan(lp) for c in clean for lp in c[1])


def test_good_weights_after_nonfinite_ones_give_clean_outputs(engine, qwen3_dir):
    """The reported sequence: non-finite weights loaded (here through the opt-out), generate, then the
    good weights back: the next 16 completions equal those of a fresh engine."""
    good = state_list(load_hf(qwen3_dir))
    prompts = [PROMPTS[i % len(PROMPTS)] + [i + 3] for i in range(16)]
    fresh = completions(Engine(qwen3_dir, max_total_tokens=1024, **CPU), prompts)
    bad = [(n, torch.full_like(t, NAN)) for n, t in good if "layers.1." in n]
    loader.load_tensors(engine.model, bad, check_finite=False)
    engine.flush_cache()
    completions(engine, prompts)  # writes NaN keys and values all over the pool
    engine.update_weights_from_tensor(good)
    assert completions(engine, prompts) == fresh


@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("how", ["list", "bucket"])
def test_nonfinite_update_is_refused_naming_the_tensor(engine, trainer, intact, value, dtype, how):
    named = state_list(trainer, dtype)
    bad, t = named[5][0], named[5][1].clone()  # a copy: the trainer model stays as it is
    t.view(-1)[7] = value
    named[5] = (bad, t)
    with pytest.raises(ValueError, match=rf"NaN or inf.*{bad}|{bad}.*NaN or inf"):
        if how == "list":
            engine.update_weights_from_tensor(named)
        else:
            engine.update_weights_from_tensor(pack(named), load_format="flattened_bucket")


def test_nonfinite_checkpoint_is_refused(engine, qwen3_dir, tmp_path, intact):
    bad = tmp_path / "bad"
    shutil.copytree(qwen3_dir, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.norm.weight"][3] = INF
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight.*NaN or inf|NaN or inf.*model.norm.weight"):
        engine.update_weights_from_disk(bad)
    with pytest.raises(ValueError, match="NaN or inf"):
        Engine(str(bad), max_total_tokens=256, **CPU)


def test_check_finite_false_loads_nonfinite_weights(qwen3_dir):
    engine = Engine(qwen3_dir, max_total_tokens=256, **CPU)
    nan = torch.full((64,), NAN)
    assert loader.load_tensors(engine.model, [("model.norm.weight", nan)], check_finite=False) == 1
    assert engine.get_weights_by_name("model.norm.weight").isnan().all()


def test_refuse_nonfinite_sees_every_float_dtype_without_false_alarms():
    dtypes = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]
    fine = [(f"ok.{d}", torch.linspace(-400, 400, 33).to(d)) for d in dtypes]
    fine += [("huge", torch.tensor([1e300, -1e300], dtype=torch.float64)), ("empty", torch.zeros(0))]
    loader.refuse_nonfinite(fine)  # large finite values are no alarm
    for d in dtypes:
        values = [NAN] if d == torch.float8_e4m3fn else [NAN, INF, -INF]  # e4m3fn has no inf
        for v in values:
            t = torch.zeros(40, dtype=torch.float32)
            t[17] = v
            with pytest.raises(ValueError, match=f"'bad.{d}'"):
                loader.refuse_nonfinite([*fine, (f"bad.{d}", t.to(d))])


# -- 2. half-applied updates ---------------------------------------------------------------------
def _uncopyable(kind: str, like: torch.Tensor):
    if kind == "meta":
        return like.to("meta")
    if kind == "sparse coo":
        return like.to_sparse()
    if kind == "sparse csr":
        return like.to_sparse_csr()
    if kind == "nested":
        return torch.nested.nested_tensor([like], layout=torch.jagged)
    if kind == "complex":
        return like.to(torch.complex64)
    if kind == "float4":
        return torch.zeros(like.shape, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    if kind == "int":
        return like.to(torch.int64)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["meta", "sparse coo", "sparse csr", "nested", "complex", "float4", "int"])
def test_an_uncopyable_tensor_after_good_ones_writes_nothing(engine, trainer, intact, kind):
    named = state_list(trainer)
    last = max(i for i, (_, t) in enumerate(named) if t.dim() == 2)  # good tensors come before it
    name, t = named[last]
    named[last] = (name, _uncopyable(kind, t))
    with pytest.raises(TypeError, match=name):
        engine.update_weights_from_tensor(named)


def test_bucket_metadata_takes_dtype_names(engine, trainer, qwen3_dir):
    named = state_list(trainer)
    b = pack(named[:4] + [(named[4][0], named[4][1].bfloat16())])
    names = ["float32", "torch.float32", "F32", "fp32", "bf16"]
    metas = [TensorMeta(m.name, s, list(m.shape), m.offset) for m, s in zip(b.metas, names)]
    assert engine.update_weights_from_tensor(FlattenedBucket(b.buffer, metas), "flattened_bucket") == 5
    for name, t in named[:4]:
        assert torch.equal(engine.get_weights_by_name(name), t)
    metas[2] = TensorMeta(metas[2].name, "bfloat17", metas[2].shape, metas[2].offset)
    with pytest.raises(TypeError, match=f"dtype of {metas[2].name!r}: 'bfloat17' is not a torch dtype"):
        engine.update_weights_from_tensor(FlattenedBucket(b.buffer, metas), "flattened_bucket")
    engine.update_weights_from_disk(qwen3_dir)


def test_parse_dtype_takes_torch_short_and_safetensors_names():
    for names, dtype in [
        (["bfloat16", "torch.bfloat16", "bf16", "BF16", torch.bfloat16], torch.bfloat16),
        (["float16", "half", "fp16", "F16"], torch.float16),
        (["float32", "float", "torch.float32", "fp32", "F32"], torch.float32),
        (["F8_E4M3", "float8_e4m3fn"], torch.float8_e4m3fn),
    ]:
        assert all(parse_dtype(n) is dtype for n in names), names
    for bad in ["bfloat17", "Tensor", "", 16, None, float]:
        with pytest.raises(TypeError, match="not a torch dtype"):
            parse_dtype(bad)


@pytest.mark.parametrize("buffer", ["meta", "sparse"])
def test_bucket_with_a_buffer_holding_no_bytes_is_refused(engine, trainer, intact, buffer):
    b = pack(state_list(trainer)[:3])
    buf = b.buffer.to("meta") if buffer == "meta" else b.buffer.to_sparse()
    with pytest.raises(TypeError, match="bucket buffer must be a dense tensor"):
        engine.update_weights_from_tensor(FlattenedBucket(buf, b.metas), "flattened_bucket")


# -- 3. SamplingParams ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(temperature=NAN), ValueError, "temperature must be a finite number"),
        (dict(temperature=INF), ValueError, "temperature must be a finite number"),
        (dict(temperature=1e-40), ValueError, "temperature must be 0"),
        (dict(top_p=NAN), ValueError, "top_p"),
        (dict(top_p=INF), ValueError, "top_p"),
        (dict(min_p=NAN), ValueError, "min_p"),
        (dict(min_p=-INF), ValueError, "min_p"),
        (dict(stop=5), TypeError, "stop must be"),
        (dict(stop=b"x"), TypeError, "stop must be"),
        (dict(stop_token_ids=5), TypeError, "stop_token_ids must be a list"),
        (dict(stop_token_ids="12"), TypeError, "stop_token_ids must be a list"),
        (dict(stop_token_ids=[2.0]), TypeError, "stop_token_ids must be an int"),
        (dict(logprobs="no"), TypeError, "logprobs must be a bool"),
        (dict(logprobs=1), TypeError, "logprobs must be a bool"),
        (dict(ignore_eos="false"), TypeError, "ignore_eos must be a bool"),
        (dict(skip_special_tokens=None), TypeError, "skip_special_tokens must be a bool"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_check_params_against_the_vocabulary():
    ok = [SamplingParams(stop_token_ids=[0, 80], top_logprobs=81)]
    requests.check_params(ok, 81)
    with pytest.raises(ValueError, match=r"sampling_params\[1\].stop_token_ids holds 81"):
        requests.check_params([*ok, SamplingParams(stop_token_ids=[3, 81])], 81)
    with pytest.raises(ValueError, match=r"sampling_params\[0\].top_logprobs=82"):
        requests.check_params([SamplingParams(top_logprobs=82)], 81)


@pytest.mark.parametrize("field", [dict(stop_token_ids=[10**6]), dict(top_logprobs=10**6)])
def test_engine_refuses_params_outside_the_vocabulary(engine, field):
    ok = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    before = engine.generate(input_ids=[[5, 6]], sampling_params=ok)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=next(iter(field))):
        engine.generate(input_ids=[[5, 6]], sampling_params=SamplingParams(**field))
    assert engine.generate(input_ids=[[5, 6]], sampling_params=ok)[0].outputs[0].token_ids == before


# -- 4. checkpoint errors -------------------------------------------------------------------------
def _broken_file(folder: Path, how: str) -> Path:
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) - 100], "garbage": b"not safetensors", "empty": b""}[how])
    return f


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors_file_is_named(engine, qwen3_dir, tmp_path, intact, how):
    bad = tmp_path / "bad"
    shutil.copytree(qwen3_dir, bad)
    f = _broken_file(bad, how)
    with pytest.raises(ValueError, match=f"checkpoint file '{f}' is not a readable safetensors file"):
        Engine(str(bad), max_total_tokens=256, **CPU)
    with pytest.raises(ValueError, match=f"checkpoint file '{f}'"):
        engine.update_weights_from_disk(bad)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    from rollout.models.toy import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("sharded") / "q", "qwen3", seed=4, max_shard_size="60KB")


def _with_index(sharded: Path, tmp_path: Path, edit) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(sharded, folder)
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    index.write_text(edit(data) if callable(edit) else edit)
    return folder


def test_a_sharded_checkpoint_loads_and_may_hold_symlinks(sharded, tmp_path):
    folder = _with_index(sharded, tmp_path, json.dumps)
    assert len(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]) > 3
    blobs = tmp_path / "blobs"  # a Hugging Face cache: snapshot files are symlinks to blobs elsewhere
    blobs.mkdir()
    for f in folder.glob("*.safetensors"):
        f.rename(blobs / f.name)
        f.symlink_to(blobs / f.name)
    assert Engine(str(folder), max_total_tokens=256, **CPU).generate(input_ids=[[5]])[0].outputs


@pytest.mark.parametrize(
    "edit, match",
    [
        ("{not json", "is not readable JSON"),
        ('{"metadata": {}}', "'weight_map' is missing"),
        ('{"weight_map": []}', "'weight_map' is missing"),
        ('["weight_map"]', "'weight_map' is missing"),
    ],
)
def test_bad_index_names_the_file_and_field(sharded, tmp_path, edit, match):
    folder = _with_index(sharded, tmp_path, edit)
    index = folder / "model.safetensors.index.json"
    with pytest.raises(ValueError, match=f"checkpoint index '{index}'.*{match}|{match}"):
        Engine(str(folder), max_total_tokens=256, **CPU)


@pytest.mark.parametrize("where", ["../outside/{}", "{abs}", "sub/../../outside/{}", 7])
def test_weight_map_entries_stay_inside_the_folder(sharded, tmp_path, where):
    outside = tmp_path / "outside"  # a real checkpoint there: following the entry would load it
    shutil.copytree(sharded, outside)

    def edit(data):
        name, file = next(iter(data["weight_map"].items()))
        target = where if isinstance(where, int) else where.format(file, abs=outside / file)
        data["weight_map"][name] = target
        return json.dumps(data)

    folder = _with_index(sharded, tmp_path, edit)
    with pytest.raises(ValueError, match="'weight_map' entry .* is not a file name inside the checkpoint"):
        Engine(str(folder), max_total_tokens=256, **CPU)


# -- 5. seeded sampling whatever the batch -------------------------------------------------------
V = 2100  # three inverse-CDF blocks


def tied_row() -> torch.Tensor:
    """Groups of exactly equal logits, straddling the top-k / top-p / min-p boundaries and blocks."""
    row = torch.full((V,), -6.0)
    row[[3, 900, 1500, 2050]] = 2.0  # a four-way tie for the top
    row[[4, 1024, 1030, 2099]] = 1.0
    row[100:140] = 0.0
    return row


TIED = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.5),
    SamplingParams(temperature=1.0, top_k=6),
    SamplingParams(temperature=1.0, top_k=2),
    SamplingParams(temperature=1.3, min_p=0.3),
    SamplingParams(temperature=1.0, top_k=50, top_p=0.95, min_p=0.01),
]
OTHERS = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_p=0.3), SamplingParams()]


def draws(row_params: SamplingParams, us: list[float], neighbours: list[SamplingParams]) -> list[int]:
    """The tied row's token for each u, sampled in a batch with `neighbours` (random rows) around it."""
    gen = torch.Generator().manual_seed(len(neighbours))
    got = []
    for u in us:
        params = [*neighbours[: len(neighbours) // 2], row_params, *neighbours[len(neighbours) // 2 :]]
        logits = torch.randn(len(params), V, generator=gen) * 3
        me = len(neighbours) // 2
        logits[me] = tied_row()
        uniforms = torch.rand(len(params), dtype=torch.float64, generator=gen).tolist()
        uniforms[me] = u
        got.append(sample(logits, SamplingBatch.build(params, uniforms, V, torch.device("cpu"))).tokens[me])
    return [int(t) for t in got]


@pytest.mark.parametrize("params", TIED, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_a_seeded_draw_does_not_depend_on_the_batch(params):
    us = torch.rand(40, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).tolist()
    alone = draws(params, us, [])
    for neighbours in ([OTHERS[0]], OTHERS, OTHERS * 5, [SamplingParams(top_k=1)] * 3):
        assert draws(params, us, neighbours) == alone, neighbours


def test_ties_rank_by_the_lower_token_id():
    us = torch.linspace(0.001, 0.999, 200, dtype=torch.float64).tolist()
    # top_k=2 inside a four-way tie keeps its two lowest ids
    assert set(draws(SamplingParams(top_k=2), us, OTHERS)) == {3, 900}
    sb = SamplingBatch.build([SamplingParams(top_logprobs=8)] * 2, [0.5, 0.5], V, torch.device("cpu"))
    res = sample(torch.stack([tied_row(), tied_row()]), sb)
    assert res.top_ids.tolist() == [[3, 900, 1500, 2050, 4, 1024, 1030, 2099]] * 2


def test_seeded_requests_sample_the_same_tokens_in_any_company(engine):
    prompt = [5, 6, 7, 8]
    seeded = [
        SamplingParams(n=2, temperature=1.0, seed=11, max_new_tokens=12, ignore_eos=True),
        SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=12, max_new_tokens=12, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, min_p=0.05, seed=13, max_new_tokens=12, ignore_eos=True),
    ]
    company = [
        SamplingParams(n=3, temperature=1.0, top_p=0.5, max_new_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, top_k=3, max_new_tokens=16, ignore_eos=True),
    ]
    for p in seeded:
        alone = [c.token_ids for c in engine.generate(input_ids=[prompt], sampling_params=p)[0].outputs]
        for other in company:
            outs = engine.generate(input_ids=[[9, 10], prompt, [11] * 7], sampling_params=[other, p, other])
            assert [c.token_ids for c in outs[1].outputs] == alone, (p, other)


def test_top_k_beyond_any_vocabulary_is_off(engine):
    p = dict(temperature=1.0, seed=5, max_new_tokens=6, ignore_eos=True)
    huge = engine.generate(input_ids=[[5, 6]], sampling_params=SamplingParams(top_k=10**30, **p))
    off = engine.generate(input_ids=[[5, 6]], sampling_params=SamplingParams(**p))
    assert huge[0].outputs[0].token_ids == off[0].outputs[0].token_ids


@pytest.mark.gpu
def test_a_seeded_draw_does_not_depend_on_the_batch_gpu():
    """On the GPU the reduction and sort kernels change with the batch's shape."""
    cuda = torch.device("cuda")
    row = tied_row().to(cuda)
    us = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for params in TIED:
        results = []
        for rows in (1, 7, 64, 300):
            logits = torch.randn(rows * 64, V, device=cuda) * 3
            logits[::rows] = row
            uniforms = torch.rand(rows * 64, dtype=torch.float64)
            uniforms[::rows] = us
            sb = SamplingBatch.build([params] * (rows * 64), uniforms.tolist(), V, cuda)
            results.append(sample(logits, sb).tokens[::rows].tolist())
        assert all(r == results[0] for r in results), params


# -- 6. the weight-update rendezvous -------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(2, tmp_path_factory.mktemp("rendezvous"))
    yield c
    c.close()


def listening(port: int) -> list[str]:
    """Local addresses of the sockets listening on `port` (hex, as /proc/net shows them)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.append(address)
    return found


def join(port: int, secrets: list, timeout: float, env_secret: str | None = None):
    """Rank r joins a group of two with secrets[r]; returns what happened, how long it took and, on
    rank 0, which addresses listened on the port while the group stood."""
    import torch.distributed as dist

    from rollout.weights.broadcast import SECRET_ENV, broadcast, join_group, leave_group

    rank = dist.get_rank()
    if env_secret is not None:
        os.environ[SECRET_ENV] = env_secret
    t0 = time.monotonic()
    try:
        group = join_group(
            "127.0.0.1", port, rank, 2, f"g{port}", "gloo", device=torch.device("cpu"),
            timeout=timeout, secret=secrets[rank],
        )  # fmt: skip
    except (PermissionError, TimeoutError) as e:
        return type(e).__name__, str(e), time.monotonic() - t0, None
    finally:
        os.environ.pop(SECRET_ENV, None)
    addresses = listening(port) if rank == 0 else None
    x = torch.full((3,), float(rank))
    broadcast(x, group)
    leave_group(group)
    return "joined", x.tolist(), time.monotonic() - t0, addresses


def test_the_host_listens_on_master_address_only(cluster):
    host, member = cluster.values(join, free_port(), [None, None], 60.0)
    assert host[0] == member[0] == "joined" and member[1] == [0.0] * 3
    assert host[3] == ["0100007F"]  # 127.0.0.1 alone, not "::" (every interface)


def test_a_shared_secret_admits_members_that_know_it(cluster):
    outs = cluster.values(join, free_port(), ["s3cret", None], 60.0, "s3cret")  # rank 1: from the env
    assert [o[0] for o in outs] == ["joined", "joined"] and outs[1][1] == [0.0] * 3


@pytest.mark.parametrize(
    "secrets, slow",
    [
        (["right", "wrong"], None),
        (["right", None], None),
        ([None, "right"], 0),  # rank 0 learns of it when the group times out
    ],
    ids=["wrong", "member-has-none", "host-has-none"],
)
def test_a_wrong_or_missing_secret_is_refused_on_both_sides(cluster, secrets, slow):
    timeout = 6.0
    outs = cluster.values(join, free_port(), secrets, timeout)
    for rank, (what, message, seconds, _) in enumerate(outs):
        assert what == "PermissionError", (rank, what, message)
        assert "secret" in message and f"rank {rank} of 2" in message
        assert seconds < (timeout + 10 if rank == slow else timeout / 2), (rank, seconds)
