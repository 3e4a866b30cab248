"""The GPU fast path: attention backends against the torch reference and transformers, CUDA-graph replay,
and the host-side logic behind them (graph ladder, padding, page-table mirror, flashinfer's CSR arrays).

CPU tests run the Triton backend in the Triton interpreter. GPU tests (marker `gpu`) run bf16 models on
a CUDA device; flashinfer tests skip when flashinfer is not installed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import types

import numpy as np
import pytest
import torch
from helpers import arrive_one_a_step

# the interpreter must be chosen before triton is first imported (torch does not import it on a CPU)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rollout import Engine, SamplingParams
from rollout.attention.base import ForwardContext
from rollout.models.toy import build_checkpoint
from rollout.runner.graphs import GraphRunner, batch_ladder, padded_size
from rollout.runner.page_table import HostPageTable
from rollout.state.scheduled import ScheduledBatch
from rollout.state.sequence import Sequence, Status

HAS_TRITON_KERNELS = importlib.util.find_spec("triton") is not None and (
    importlib.util.find_spec("rollout.attention.triton_kernels") is not None
)
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
# CPU tests of the Triton backend run its kernels in the interpreter, which is only on without CUDA
needs_interpreter = pytest.mark.skipif(
    not HAS_TRITON_KERNELS or torch.cuda.is_available(),
    reason="needs triton and triton_kernels.py, and no CUDA (the GPU tests cover the kernels there)",
)


def prompt_ids(n: int) -> list[int]:
    """n token ids inside the toy vocabulary (81 ids)."""
    return [3 + i % 70 for i in range(n)]


def make_seq(seq_id: int, tokens: list[int], pages: list[int], computed: int, status=Status.RUNNING):
    seq = Sequence(seq_id, seq_id, 0, list(tokens), len(tokens), SamplingParams(), seq_id)
    seq.pages, seq.num_computed, seq.status = list(pages), computed, status
    return seq


# -- graph ladder ---------------------------------------------------------------------------------------
def test_batch_ladder_and_padding():
    ladder = batch_ladder(256)
    assert ladder[:8] == [1, 2, 4, 8, 16, 24, 32, 48] and ladder[-1] == 256
    assert ladder == sorted(set(ladder))
    assert batch_ladder(5) == [1, 2, 4, 5] and batch_ladder(1) == [1] and batch_ladder(40)[-1] == 40
    for b in range(1, 257):
        p = padded_size(ladder, b)
        assert p >= b and not any(b <= s < p for s in ladder)
    assert padded_size(ladder, 257) is None
    with pytest.raises(ValueError, match="largest CUDA-graph batch"):
        batch_ladder(0)


# -- page-table mirror ----------------------------------------------------------------------------------
def test_host_page_table_follows_growth_replacement_and_reuse():
    table = HostPageTable(num_rows=2, max_pages=2)  # tiny: forces widening, reclaiming and growing
    a, b = make_seq(0, [1] * 8, [3, 4], 8), make_seq(1, [1] * 4, [5], 4)

    def check(seqs):
        rows = table.rows(seqs)
        width = max(len(s.pages) for s in seqs)
        got = table.gather(rows, width)
        for seq, row in zip(seqs, got):
            assert row[: len(seq.pages)].tolist() == seq.pages

    check([a, b])
    a.pages += [6, 7, 8]  # grown in place (the scheduler's _grow), past the initial width
    check([a, b])
    a.pages = [9]  # freed and re-admitted with a new, shorter list
    check([b, a])
    a.status = Status.FINISHED  # its row is reclaimed for c; d needs the table to grow
    c, d = make_seq(2, [1] * 4, [10, 11], 4), make_seq(3, [1] * 4, [12], 4)
    check([b, c])
    check([b, c, d])
    assert table.table.shape[0] >= 3


def test_host_batch_matches_a_direct_construction(qwen3_dir):
    engine = Engine(qwen3_dir, device="cpu", page_size=4, max_total_tokens=512)
    rng = np.random.default_rng(0)
    seqs, chunks = [], []
    for i, (length, done) in enumerate([(9, 0), (13, 8), (4, 0), (30, 29)]):
        pages = rng.permutation(engine.kv.num_pages)[: -(-length // 4)].tolist()
        seqs.append(make_seq(i, rng.integers(0, 60, length).tolist(), pages, done))
        chunks.append(length - done)
    host = engine.runner.host_batch(ScheduledBatch(seqs, chunks, decode=False))
    ids, positions, slots = [], [], []
    for seq, chunk in zip(seqs, chunks):
        for p in range(seq.num_computed, seq.num_computed + chunk):
            ids.append(seq.token_ids[p]), positions.append(p)
            slots.append(seq.pages[p // 4] * 4 + p % 4)
    assert host.ids.tolist() == ids and host.positions.tolist() == positions
    assert host.slots.tolist() == slots and host.sampled.tolist() == [0, 1, 2, 3]
    assert host.seq_lens.tolist() == [9, 13, 4, 30]
    for seq, row in zip(seqs, host.page_table):
        assert row[: len(seq.pages)].tolist() == seq.pages

    decode = [make_seq(10 + i, [7] * n, s.pages, n - 1) for i, (n, s) in enumerate(zip([9, 13], seqs))]
    host = engine.runner.host_batch(ScheduledBatch(decode, [1, 1], decode=True))
    assert host.positions.tolist() == [8, 12] and host.ids.tolist() == [7, 7]
    assert host.slots.tolist() == [decode[0].pages[2] * 4, decode[1].pages[3] * 4]


# -- host-side batching helpers -------------------------------------------------------------------------
def test_batched_uniforms_equal_a_scalar_splitmix():
    from rollout.state.sequence import uniforms

    rng = np.random.default_rng(0)
    seeds = [0, -1, 2**64 - 1, -(10**30), 10**30, *rng.integers(0, 2**63, 50).tolist()]
    seqs = [Sequence(i, i, 0, [1] * (3 + i), 3, SamplingParams(), seed) for i, seed in enumerate(seeds)]
    assert uniforms(seqs).tolist() == [splitmix_uniform(s.seed, s.num_output + 1) for s in seqs]


def splitmix_uniform(seed: int, draw: int) -> float:
    """The hash of `uniforms`, one sequence at a time in Python integers (the reference)."""
    mask = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + draw * 0xD1B54A32D192ED03) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    x ^= x >> 31
    return ((x >> 11) + 0.5) / float(1 << 53)


def test_packed_upload_keeps_dtypes_shapes_and_alignment():
    from rollout.device.staging import to_device

    arrays = [
        np.arange(5, dtype=np.int64),
        np.arange(6, dtype=np.int32).reshape(2, 3),
        np.array([0.1, 0.2], dtype=np.float32),
        np.array([0.3], dtype=np.float64),
        np.zeros(0, dtype=np.int32),
    ]
    out = to_device(arrays, torch.device("cpu"))
    for a, t in zip(arrays, out):
        assert t.dtype == torch.from_numpy(a).dtype and tuple(t.shape) == a.shape
        assert t.numpy().tolist() == a.tolist()
        assert a.size == 0 or t.data_ptr() % 16 == 0


# -- flashinfer's CSR arrays (pure numpy; a stand-in module replaces a missing flashinfer) ---------------
@pytest.fixture
def flashinfer_backend_module(monkeypatch):
    name = "rollout.attention.flashinfer_backend"
    if HAS_FLASHINFER:
        yield importlib.import_module(name)
        return
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    sys.modules.pop(name, None)
    yield importlib.import_module(name)
    sys.modules.pop(name, None)  # never leave a module bound to the stand-in behind


def test_paged_csr_for_flashinfer(flashinfer_backend_module):
    table = np.array([[7, 0, 0], [3, 4, 0], [5, 6, 8], [99, 1, 1]], dtype=np.int32)
    indptr, indices, last = flashinfer_backend_module.paged_csr([1, 16, 33, 0], table, 16)
    assert indptr.tolist() == [0, 1, 2, 5, 6]
    assert indices.tolist() == [7, 3, 5, 6, 8, 99]  # padding row (seq_len 0): its column 0, one token
    assert last.tolist() == [1, 16, 1, 1]
    assert indptr.dtype == indices.dtype == last.dtype == np.int32


# -- Triton backend and graph padding on the CPU (Triton interpreter) -----------------------------------
def triton_engine(path: str, **options) -> Engine:
    from rollout.attention.triton_backend import TritonBackend

    engine = Engine(path, device="cpu", page_size=4, max_total_tokens=512, **options)
    torch_backend = engine.runner.backend
    engine.runner.backend = TritonBackend(
        engine.kv, torch_backend.num_heads, torch_backend.head_dim, torch_backend.sm_scale
    )
    return engine


@needs_interpreter
def test_triton_backend_matches_torch_backend_on_cpu(checkpoints):
    prompts = [list(range(5, 14)), [3, 4]]  # 9 tokens cross two page boundaries (page_size 4)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=3, ignore_eos=True, logprobs=True)
    ref = Engine(checkpoints["qwen2"], device="cpu", page_size=4, max_total_tokens=512)
    ref_out = ref.generate(input_ids=prompts, sampling_params=params)
    out = triton_engine(checkpoints["qwen2"]).generate(input_ids=prompts, sampling_params=params)
    for a, b in zip(ref_out, out):
        for x, y in zip(a.outputs, b.outputs):  # n=2: the second sample extends a cached prefix
            assert x.token_ids == y.token_ids
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4


@needs_interpreter
def test_graph_padding_rows_touch_only_the_scratch_page(qwen3_dir):
    engine = triton_engine(qwen3_dir)
    runner, kv = engine.runner, engine.kv
    seqs = [make_seq(i, list(range(1, n + 1)), [], 0) for i, n in enumerate([5, 2, 7])]
    for seq in seqs:
        seq.pages = engine.pages.allocate(2)
    runner.step(ScheduledBatch(seqs, [s.num_tokens for s in seqs], decode=False))
    for seq in seqs:
        seq.num_computed = seq.num_tokens
        seq.token_ids.append(9)
    host = runner.host_batch(ScheduledBatch(seqs, [1, 1, 1], decode=True))

    graphs = GraphRunner(
        engine.model,
        runner.backend,
        max_bs=4,
        max_pages=8,
        hidden_size=engine.model_config.hidden_size,
        dtype=engine.dtype,
        device=engine.device,
    )
    inputs = graphs.load(host, None)
    assert inputs.graph_bs == 4 and inputs.logit_rows == slice(0, 3)
    assert inputs.attn.seq_lens.tolist() == [6, 3, 8, 0]
    assert inputs.attn.slot_mapping[3].item() == kv.scratch_page * 4
    assert (inputs.attn.page_table_cpu[3] == kv.scratch_page).all()

    before = kv.data.clone()
    with torch.inference_mode():
        ctx = ForwardContext(runner.backend, runner.backend.begin_graph(inputs.attn))
        padded = engine.model(inputs.input_ids, inputs.positions, ctx)
        changed = (kv.data != before).flatten(4).any(-1)  # [layer, k|v, page, slot]
        written = {(int(p), int(s)) for p, s in changed.any(0).any(0).nonzero().tolist()}
        real = {(int(x) // 4, int(x) % 4) for x in host.slots}
        assert real <= written and written - real <= {(kv.scratch_page, 0)}
        kv.data.copy_(before)
        eager = runner.eager_inputs(host, None)
        ref = engine.model(eager.input_ids, eager.positions, ForwardContext(runner.backend, eager.attn))
    torch.testing.assert_close(padded[:3], ref, atol=1e-5, rtol=1e-5)


class ReplayEagerly(GraphRunner):
    """The graph runner with 'graphs' that re-run the captured step eagerly: the static buffers, padding
    and replay path of CUDA-graph decode, checked on a CPU."""

    def _record(self, run):
        return types.SimpleNamespace(replay=run)


@needs_interpreter
def test_graph_decode_path_matches_eager_generation_on_cpu(checkpoints):
    prompts = [list(range(5, 14)), [3, 4], list(range(20, 26))]
    greedy = dict(temperature=0, ignore_eos=True, logprobs=True)
    params = [SamplingParams(n=n, max_new_tokens=m, **greedy) for n, m in ((2, 2), (1, 5), (2, 3))]
    ref = Engine(checkpoints["qwen2"], device="cpu", page_size=4, max_total_tokens=512)
    ref_out = ref.generate(input_ids=prompts, sampling_params=params)
    # unmixed: the followers' prefill steps would otherwise carry the decoding rows the graphs should run
    engine = triton_engine(checkpoints["qwen2"], mixed_chunk=False)
    runner = engine.runner
    graphs = ReplayEagerly(
        engine.model,
        runner.backend,
        max_bs=4,  # 5 samples: eager decode, then 3 in a graph of 4 (one padding row), then 1
        max_pages=engine.max_model_len // 4,
        hidden_size=engine.model_config.hidden_size,
        dtype=engine.dtype,
        device=engine.device,
    )
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4]
    runner.graphs = graphs
    replays = []
    replay = graphs.replay
    graphs.replay = lambda inputs: replays.append((inputs.graph_bs, inputs.logit_rows.stop)) or replay(inputs)
    out = engine.generate(input_ids=prompts, sampling_params=params)
    assert (4, 3) in replays and (1, 1) in replays
    for a, b in zip(ref_out, out):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4


# -- GPU: bf16 against the torch backend and transformers -----------------------------------------------
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
COMMON = dict(num_hidden_layers=2, max_position_embeddings=2048)
# query-group sizes 1, 4, 7, 2 and head dims 64 / 128, as in the benchmark models (Qwen2.5-0.5B: 14/2
# heads of 64, so a group of 7 takes flashinfer's tensor-core decode path)
GPU_VARIANTS = {
    "llama": dict(
        arch="llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4,
        rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True, seed=1,
    ),
    "mistral": dict(
        arch="mistral", hidden_size=512, intermediate_size=1024, num_attention_heads=8,
        num_key_value_heads=2, seed=2,
    ),
    "qwen2": dict(
        arch="qwen2", hidden_size=448, intermediate_size=896, num_attention_heads=7, num_key_value_heads=1,
        seed=3,
    ),
    "qwen3": dict(
        arch="qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
        head_dim=128, tie_word_embeddings=True, seed=4,
    ),
}  # fmt: skip
FAMILIES = list(GPU_VARIANTS)
no_flashinfer = pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer is not installed")
FAST = ["triton", pytest.param("flashinfer", marks=no_flashinfer)]


@pytest.fixture(scope="session")
def gpu_checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gpu_ckpt")
    return {name: str(build_checkpoint(root / name, **COMMON, **kw)) for name, kw in GPU_VARIANTS.items()}


def gpu_engine(path: str, backend: str, **options) -> Engine:
    options = {"page_size": 16, "max_total_tokens": 16384, "max_running_requests": 32, **options}
    return Engine(path, device="cuda", dtype="bfloat16", attention_backend=backend, **options)


@torch.inference_mode()
def step_logits(engine: Engine, prompts: list[list[int]], extra: list[int]) -> list[torch.Tensor]:
    """Logits at every position of prompt + extra for each prompt: one prefill step over the prompts
    (all rows), then one decode step per extra token; float32 [len(prompt) + len(extra), vocab] each."""
    runner = engine.runner
    seqs = []
    for i, p in enumerate(prompts):
        seq = make_seq(i, p, [], 0)
        seq.pages = engine.pages.allocate(-(-(len(p) + len(extra)) // engine.kv.page_size))
        seqs.append(seq)
    inputs = runner.prepare(ScheduledBatch(seqs, [len(p) for p in prompts], decode=False))
    inputs.logit_rows = torch.arange(sum(map(len, prompts)), device="cuda")
    rows = list(runner.forward_logits(inputs).split([len(p) for p in prompts]))
    for token in extra:
        for seq in seqs:
            seq.num_computed = seq.num_tokens
            seq.token_ids.append(token)
        decode = runner.forward_logits(runner.prepare(ScheduledBatch(seqs, [1] * len(seqs), decode=True)))
        rows = [torch.cat([r, d[None]]) for r, d in zip(rows, decode)]
    for seq in seqs:
        engine.pages.release(seq.pages)
    return rows


@functools.lru_cache(maxsize=2)
def hf_model(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()


@torch.inference_mode()
def hf_logits(path: str, dtype: torch.dtype, tokens: list[int]) -> torch.Tensor:
    return hf_model(path, dtype)(torch.tensor([tokens], device="cuda")).logits[0].float()


MIXED_PROMPTS = [prompt_ids(n) for n in (1, 15, 16, 17, 40)]  # page boundaries at 16
EXTRA = [11, 12, 13, 14, 15]  # 5 decode steps: the 15/16/17-token prompts cross a page while decoding


@pytest.mark.gpu
@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_match_torch_backend_and_transformers(family, backend, gpu_checkpoints):
    """Tolerance: bf16 keeps 8 mantissa bits, so a bf16 forward is off from the float32 one by rounding
    noise. A correct backend must be no further from float32 transformers than transformers' own bf16
    forward is (times 1.5, plus 0.02 for different rounding points), and as close to our torch backend;
    a wrong page, mask or position moves logits by their own scale (several units)."""
    path = gpu_checkpoints[family]
    fast = step_logits(gpu_engine(path, backend, cuda_graph=False), MIXED_PROMPTS, EXTRA)
    ref = step_logits(gpu_engine(path, "torch", cuda_graph=False), MIXED_PROMPTS, EXTRA)
    for prompt, f, r in zip(MIXED_PROMPTS, fast, ref):
        tokens = prompt + EXTRA
        exact = hf_logits(path, torch.float32, tokens)
        hf_bf16_err = (hf_logits(path, torch.bfloat16, tokens) - exact).abs().max().item()
        bound = 1.5 * hf_bf16_err + 0.02
        fast_err, ref_err = (f - exact).abs().max().item(), (r - exact).abs().max().item()
        print(f"{family}/{backend} len {len(prompt)}: |fast-fp32| {fast_err:.4f} |torch-fp32| {ref_err:.4f} "
              f"|hf_bf16-fp32| {hf_bf16_err:.4f} (logit scale {exact.abs().max().item():.2f})")  # fmt: skip
        assert fast_err <= bound and ref_err <= bound
        assert (f - r).abs().max().item() <= bound


@pytest.mark.gpu
@pytest.mark.parametrize("backend", FAST)
def test_graph_replay_equals_eager_exactly(backend, gpu_checkpoints):
    engine = gpu_engine(gpu_checkpoints["qwen2"], backend, max_running_requests=16)
    graphs = engine.runner.graphs
    assert sorted(graphs.graphs) == [1, 2, 4, 8, 16] and graphs.capture_seconds > 0
    seqs = [make_seq(i, prompt_ids(n), [], 0) for i, n in enumerate([1, 16, 17, 40, 90])]
    for seq in seqs:
        seq.pages = engine.pages.allocate(8)
    runner = engine.runner
    with torch.inference_mode():
        runner.step(ScheduledBatch(seqs, [s.num_tokens for s in seqs], decode=False))
        for seq in seqs:
            seq.num_computed = seq.num_tokens
            seq.token_ids.append(7)
        inputs = runner.prepare(ScheduledBatch(seqs, [1] * 5, decode=True))
        assert inputs.graph_bs == 8
        replayed = graphs.replay(inputs).clone()
        ctx = ForwardContext(runner.backend, runner.backend.begin_graph(inputs.attn))
        eager = engine.model(inputs.input_ids, inputs.positions, ctx)
        assert torch.equal(replayed[:5], eager[:5])
        # the non-graph decode path (its own flashinfer plan / split count) agrees up to rounding
        runner.graphs = None
        plain = runner.prepare(ScheduledBatch(seqs, [1] * 5, decode=True))
        ctx = ForwardContext(runner.backend, runner.backend.begin(plain.attn))
        other = engine.model(plain.input_ids, plain.positions, ctx)
    torch.testing.assert_close(other.float(), eager[:5].float(), atol=0.05, rtol=0.02)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_greedy_outputs_equal_across_backends(family, gpu_checkpoints):
    """Mixed prompt lengths, n=2 (the second sample extends a cached prefix), per-request lengths so the
    running batch shrinks from eager decode (past cuda_graph_max_bs=4) into graph replay. Greedy tokens
    must match the torch backend; bf16 rounding may only flip a near-tie, which is checked by the
    reference's own top-2 logprob margin at the first differing token."""
    path = gpu_checkpoints[family]
    prompts = [prompt_ids(n) for n in (1, 5, 15, 16, 17, 33, 64, 100)]
    params = [
        SamplingParams(n=2, temperature=0, max_new_tokens=8 + 6 * i, ignore_eos=True, top_logprobs=2)
        for i in range(len(prompts))
    ]
    ref = gpu_engine(path, "torch", cuda_graph=False).generate(input_ids=prompts, sampling_params=params)
    backends = ["triton"] + (["flashinfer"] if HAS_FLASHINFER else [])
    for backend in backends:
        engine = gpu_engine(path, backend, cuda_graph_max_bs=4)
        out = engine.generate(input_ids=prompts, sampling_params=params)
        for r, o in zip(ref, out):
            for x, y in zip(r.outputs, o.outputs):
                i = first_divergence(x.token_ids, y.token_ids)
                if i is None:
                    assert len(x.token_ids) == len(y.token_ids)
                    continue
                top = sorted(x.top_logprobs[i].values(), reverse=True)
                assert top[0] - top[1] < 0.05, f"{backend}: token {i} differs without a near-tie"


# -- GPU: the overlap schedule and the kept decode batch (docs/architecture.md, "The step pipeline") ----
@pytest.mark.gpu
@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("graphs", [True, False])
def test_overlap_schedule_equals_the_plain_one_gpu(backend, graphs, gpu_checkpoints):
    """bf16, CUDA graphs on and off: overlap on vs off give the same tokens (greedy and seeded, stops,
    n > 1, a mix of lengths), and every page comes back."""
    path = gpu_checkpoints["qwen2"]
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=m, logprobs=True, ignore_eos=True) for m in (3, 40, 17)
    ] + [
        SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=33, seed=5, n=3),
        SamplingParams(temperature=0.7, max_new_tokens=25, seed=8, stop_token_ids=[7, 11, 13]),
    ]
    prompts = MIXED_PROMPTS  # one per params entry
    runs = []
    for overlap in (False, True):
        engine = gpu_engine(path, backend, cuda_graph=graphs, overlap_schedule=overlap)
        out = engine.generate(input_ids=prompts, sampling_params=params)
        runs.append([[(c.token_ids, c.finish_reason) for c in o.outputs] for o in out])
        assert engine.stats.pages_free == engine.stats.pages_total
        if graphs:
            assert engine.stats.graph_steps > 0
        engine.shutdown()
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", FAST)
def test_kept_decode_batch_matches_a_rebuilt_one_gpu(backend, gpu_checkpoints):
    """Decode logits of consecutive graph-replayed steps over page boundaries equal those of the same
    steps built from scratch (runner.reset() before each): the kept page rows, skipped copies and
    reused flashinfer plan arrays are what a full build gives."""
    path = gpu_checkpoints["qwen2"]
    p = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True, logprobs=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 16, 31)]
    runs = []
    for rebuild in (False, True):
        engine = gpu_engine(path, backend)
        if rebuild:
            _rebuild_every_step(engine.runner)
        out = engine.generate(input_ids=prompts, sampling_params=p)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out])
        engine.shutdown()
    for (ta, la), (tb, lb) in zip(*runs):
        assert ta == tb and la == pytest.approx(lb, abs=1e-6)


def _rebuild_every_step(runner) -> None:
    launch = runner.launch

    def rebuilt(batch, prev=None):
        runner.reset()
        return launch(batch, prev)

    runner.launch = rebuilt


@pytest.mark.gpu
@pytest.mark.parametrize("backend", FAST)
def test_mixed_steps_match_transformers_gpu(backend, gpu_checkpoints):
    """bf16, CUDA graphs and the overlap schedule on, requests arriving one a step: the prefill steps
    carry the decoding rows (whose input ids come from the step in flight). Every sampled token's logprob
    is as close to float32 transformers as transformers' own bf16 is (the fidelity bound, with margin):
    a decoding row fed a wrong token or position would be off by O(1)."""
    path = gpu_checkpoints["qwen2"]
    engine = gpu_engine(path, backend, overlap_schedule=True)
    p = SamplingParams(temperature=1.0, max_new_tokens=24, seed=3, logprobs=True, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 16, 31, 9, 40, 17, 2, 25)]
    done, _, mixed = arrive_one_a_step(engine, [(f"r{i}", q, p) for i, q in enumerate(prompts)])
    assert mixed >= 2  # decoding rows rode in prefill steps (and every page came back)
    engine.shutdown()
    got, exact, half = [], [], []
    for i, prompt in enumerate(prompts):
        c = done[f"r{i}"].outputs[0]
        tokens = prompt + c.token_ids
        rows = torch.arange(len(prompt) - 1, len(tokens) - 1, device="cuda")
        target = torch.tensor(c.token_ids, device="cuda")
        for dtype, into in ((torch.float32, exact), (torch.bfloat16, half)):
            lp = torch.log_softmax(hf_logits(path, dtype, tokens), -1)
            into.append(lp[rows, target].cpu())
        got.append(torch.tensor(c.logprobs))
    got, exact, half = torch.cat(got), torch.cat(exact), torch.cat(half)
    engine_gap, hf_gap = (got - exact).abs().mean(), (half - exact).abs().mean()
    assert engine_gap <= 1.5 * hf_gap + 1e-3, (engine_gap, hf_gap)
