"""Release and resume of weights, KV cache and CUDA-graph memory: the state machine (CPU) and the
memory actually given back (GPU, marker `gpu`)."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import PROMPTS

from rollout import Engine, SamplingParams
from rollout.memory import MemorySaver, check_tags, expandable_segments_requested, make_memory_saver
from rollout.weights.loader import iter_checkpoint, safetensors_files

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


def greedy(engine: Engine) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def resend_weights(engine: Engine, path: str, names: set[str] | None = None) -> None:
    """What a trainer does after a release: push the checkpoint's tensors (all, or `names`)."""
    named = [(n, t.to(engine.device)) for n, t in iter_checkpoint(safetensors_files(path))]
    named = [(n, t) for n, t in named if names is None or n in names]
    engine.update_weights_from_tensor(named)


@pytest.fixture
def engine(qwen3_dir) -> Engine:
    return Engine(qwen3_dir, device="cpu", max_total_tokens=4096)


@pytest.fixture(scope="module")
def reference(qwen3_dir) -> list[list[int]]:
    return greedy(Engine(qwen3_dir, device="cpu", max_total_tokens=4096))


# -- CPU: the state machine ------------------------------------------------------------------------
def test_round_trip_with_backup_restores_outputs(engine, reference):
    assert greedy(engine) == reference  # also fills the prefix cache
    weight = engine.model.model.embed_tokens.weight
    before = weight.detach().clone()
    engine.release_memory_occupation(keep_weights_backup=True)
    assert engine.released_tags == {"weights", "kv_cache", "cuda_graph"}
    assert engine.kv.data is None and not engine.pages.index  # KV freed, prefix cache flushed
    assert torch.isnan(weight).all()  # a CPU keeps the storage but not the content
    with pytest.raises(RuntimeError, match=r"released \(weights, kv_cache, cuda_graph\)"):
        engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)
    engine.resume_memory_occupation()
    assert engine.released_tags == frozenset()
    assert torch.equal(weight, before)
    assert engine.kv.data is not None and not engine.kv.data.any()
    assert greedy(engine) == reference


def test_discarded_weights_block_generate_until_all_are_updated(engine, reference, qwen3_dir):
    engine.release_memory_occupation()  # weights discarded by default
    engine.resume_memory_occupation()
    with pytest.raises(RuntimeError, match="discarded"):
        engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)
    names = sorted(engine.model.hf_names())
    resend_weights(engine, qwen3_dir, set(names[: len(names) // 2]))
    with pytest.raises(RuntimeError, match=f"{len(names) - len(names) // 2} of {len(names)}"):
        engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)
    resend_weights(engine, qwen3_dir)
    assert greedy(engine) == reference


def test_staged_wake(engine, reference, qwen3_dir):
    engine.release_memory_occupation()
    engine.resume_memory_occupation(tags=["weights"])
    assert engine.released_tags == {"kv_cache", "cuda_graph"}
    with pytest.raises(RuntimeError, match=r"released \(kv_cache, cuda_graph\)"):
        engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)
    resend_weights(engine, qwen3_dir)
    engine.resume_memory_occupation(tags=["kv_cache", "cuda_graph"])
    assert greedy(engine) == reference


def test_weights_cannot_be_updated_while_released(engine, qwen3_dir):
    name = "model.embed_tokens.weight"
    engine.release_memory_occupation(tags=["weights"])
    with pytest.raises(RuntimeError, match="weights are released"):
        engine.get_weights_by_name(name)
    with pytest.raises(RuntimeError, match="weights are released"):
        resend_weights(engine, qwen3_dir)
    engine.resume_memory_occupation(tags="weights")
    with pytest.raises(RuntimeError, match="discarded"):
        engine.get_weights_by_name(name)  # reads of discarded weights refuse, as generate does
    resend_weights(engine, qwen3_dir)
    assert torch.isfinite(engine.get_weights_by_name(name)).all()


def _start_requests(engine: Engine) -> None:
    """Queue two requests and run one prefill step, as a step loop between steps would have them."""
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(i, prompt, SamplingParams(temperature=0.0, max_new_tokens=20, n=2))
    engine.step()


def test_release_refuses_in_flight_requests_or_aborts_them(engine, reference):
    _start_requests(engine)
    held = engine.stats.pages_total - engine.stats.pages_free
    assert held > 0
    with pytest.raises(RuntimeError, match="abort=True"):
        engine.release_memory_occupation()
    assert engine.released_tags == frozenset() and engine.kv.data is not None  # nothing changed
    assert engine.stats.pages_total - engine.stats.pages_free == held
    engine.release_memory_occupation(abort=True, keep_weights_backup=True)
    assert not engine.has_unfinished() and engine.stats.requests == 0
    aborted = engine.step()  # the aborted requests are reported by the next step
    assert len(aborted) == 2 and all(s.finish_reason == "abort" for o in aborted for s in o.outputs)
    engine.resume_memory_occupation()
    assert engine.stats.pages_free == engine.stats.pages_total
    assert greedy(engine) == reference


def test_double_release_and_resume_are_harmless(engine, reference, caplog):
    caplog.set_level(logging.INFO, logger="rollout")
    engine.resume_memory_occupation()  # nothing released yet
    assert "already resident" in caplog.text
    engine.release_memory_occupation(tags=["kv_cache"])
    engine.release_memory_occupation(tags=["kv_cache", "cuda_graph"])  # kv_cache skipped, graphs released
    assert "already released" in caplog.text
    assert engine.released_tags == {"kv_cache", "cuda_graph"}
    engine.resume_memory_occupation()
    engine.resume_memory_occupation()
    assert greedy(engine) == reference


def test_kv_only_cycle_keeps_weights(engine, reference):
    greedy(engine)
    assert engine.pages.index  # prompts cached
    engine.release_memory_occupation(tags=["kv_cache"])
    assert not engine.pages.index and engine.pages.available() == engine.pages.num_pages
    engine.resume_memory_occupation(tags=["kv_cache"])
    assert engine.kv.data.shape == engine.kv.shape
    assert greedy(engine) == reference


def test_bad_tags_raise_and_change_nothing(engine, reference):
    with pytest.raises(ValueError, match="'kv'"):
        engine.release_memory_occupation(tags=["weights", "kv"])
    with pytest.raises(ValueError, match="'graphs'"):
        engine.resume_memory_occupation(tags=["graphs"])
    with pytest.raises(TypeError, match="tags"):
        engine.release_memory_occupation(tags=5)
    assert engine.released_tags == frozenset()
    assert greedy(engine) == reference


def test_check_tags_and_disabled_saver():
    assert check_tags(None) == ["weights", "kv_cache", "cuda_graph"]
    assert check_tags("kv_cache") == ["kv_cache"]
    assert check_tags(["cuda_graph", "weights", "weights"]) == ["weights", "cuda_graph"]
    saver = make_memory_saver(True, torch.device("cpu"))  # no CUDA: the state machine alone
    assert type(saver) is MemorySaver and not saver.enabled
    with saver.region("weights"):
        pass
    saver.pause("kv_cache")
    with pytest.raises(ValueError, match="'kv'"):
        saver.region("kv")


def test_expandable_segments_detection():
    assert expandable_segments_requested({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    conf = "max_split_size_mb:64, expandable_segments:true"
    assert expandable_segments_requested({"PYTORCH_ALLOC_CONF": conf})
    assert not expandable_segments_requested({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert not expandable_segments_requested({})


# -- CPU stand-ins for the GPU paths -----------------------------------------------------------------
class FakeSaver(MemorySaver):
    """An enabled saver whose pause/resume move a fake free-memory counter (read by mem_get_info)."""

    enabled = True

    def __init__(self):
        self.free, self.calls = 1 << 30, []
        self.sizes = {"weights": 300, "kv_cache": 5000, "cuda_graph": 70}

    def pause(self, tag):
        super().pause(tag)
        self.calls.append(("pause", tag))
        self.free += self.sizes[tag]

    def resume(self, tag):
        super().resume(tag)
        self.calls.append(("resume", tag))
        self.free -= self.sizes[tag]


def test_enabled_saver_path(engine, reference, monkeypatch):
    saver = engine.memory.saver = FakeSaver()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (saver.free, 1 << 40))
    engine.release_memory_occupation(tags=["cuda_graph", "weights", "kv_cache"], keep_weights_backup=True)
    assert saver.calls == [("pause", "weights"), ("pause", "kv_cache"), ("pause", "cuda_graph")]
    assert engine.memory.paused_bytes == saver.sizes
    assert engine.kv.data is not None  # paused in place: the tensor (and its address) stays
    saver.calls.clear()
    engine.resume_memory_occupation(tags=["cuda_graph"])
    saver.free = 400  # room for the weights only: resuming the KV cache must raise, not crash
    with pytest.raises(RuntimeError, match="kv_cache needs"):
        engine.resume_memory_occupation()
    assert engine.released_tags == {"kv_cache"}  # weights came back first, then the KV check failed
    saver.free = 1 << 30
    engine.resume_memory_occupation()
    assert saver.calls == [("resume", "cuda_graph"), ("resume", "weights"), ("resume", "kv_cache")]
    assert greedy(engine) == reference


def test_cuda_saver_glue_turns_expandable_segments_off_while_allocating(monkeypatch):
    """CudaMemorySaver against a stand-in torch_memory_saver (the real one needs a GPU)."""
    import contextlib
    import os
    import sys
    import types

    from rollout.memory import CudaMemorySaver

    seen = []

    class FakeTMS:
        hook_mode = "preload"

        @contextlib.contextmanager
        def region(self, tag):
            seen.append(("region", tag, os.environ["PYTORCH_CUDA_ALLOC_CONF"]))
            yield

        def pause(self, tag):
            seen.append(("pause", tag))

        def resume(self, tag):
            seen.append(("resume", tag))

    tms = FakeTMS()
    monkeypatch.setitem(sys.modules, "torch_memory_saver", types.SimpleNamespace(torch_memory_saver=tms))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    settings = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", settings.append)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64,expandable_segments:True")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    saver = CudaMemorySaver(torch.device("cuda", 0))
    assert saver.enabled and tms.hook_mode == "torch"
    with saver.region("kv_cache"):
        pass
    saver.pause("kv_cache")
    saver.resume("kv_cache")
    hidden = "max_split_size_mb:64,expandable_segments:False"
    assert seen == [
        ("region", "weights", hidden),
        ("region", "kv_cache", hidden),
        ("pause", "kv_cache"),
        ("resume", "kv_cache"),
    ]
    assert settings == ["expandable_segments:False", "expandable_segments:True"] * 2
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"].endswith("expandable_segments:True")
    with pytest.raises(ValueError, match="'kv'"):
        saver.pause("kv")


# -- GPU: memory really goes back --------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    """One engine filling most of the GPU (the weights and KV of several tests would not fit twice)."""
    from types import SimpleNamespace

    from rollout.models.toy import build_checkpoint

    path = str(
        build_checkpoint(
            tmp_path_factory.mktemp("gpu") / "medium",
            "qwen2",
            seed=7,
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=8,
            max_position_embeddings=4096,
        )
    )
    a = torch.randn(256, 256, device="cuda")  # CUDA context and cuBLAS outside the measurement
    (a @ a).sum().item()
    torch.cuda.empty_cache()
    base = torch.cuda.mem_get_info()[0]
    engine = Engine(path, device="cuda", enable_memory_saver=True, mem_fraction=0.9)
    ref = greedy(engine)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    loaded = torch.cuda.mem_get_info()[0]
    yield SimpleNamespace(engine=engine, path=path, ref=ref, footprint=base - loaded)
    engine.resume_memory_occupation()  # never leave paused memory behind in this process


@pytest.mark.gpu
def test_gpu_release_gives_back_the_engine_footprint(gpu):
    engine = gpu.engine
    free0 = torch.cuda.mem_get_info()[0]
    engine.release_memory_occupation(keep_weights_backup=True)
    try:
        freed = torch.cuda.mem_get_info()[0] - free0
        assert freed >= 0.95 * gpu.footprint, (freed, gpu.footprint)
        other = torch.empty(int(0.95 * gpu.footprint), dtype=torch.uint8, device="cuda")
        other.fill_(7)  # the trainer's tensor really lives there
        torch.cuda.synchronize()
        del other
    finally:
        engine.resume_memory_occupation()
    assert greedy(engine) == gpu.ref


@pytest.mark.gpu
def test_gpu_staged_wake_after_resending_weights(gpu):
    engine = gpu.engine
    engine.release_memory_occupation()
    try:
        engine.resume_memory_occupation(tags=["weights"])
        with pytest.raises(RuntimeError):
            engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)
        resend_weights(engine, gpu.path)
    finally:
        engine.resume_memory_occupation()
    assert greedy(engine) == gpu.ref


@pytest.mark.gpu
def test_gpu_resume_without_room_raises_instead_of_crashing(gpu):
    engine = gpu.engine
    engine.release_memory_occupation(tags=["kv_cache"])
    try:
        hog = torch.empty(torch.cuda.mem_get_info()[0] - (256 << 20), dtype=torch.uint8, device="cuda")
        with pytest.raises(RuntimeError, match="kv_cache needs"):
            engine.resume_memory_occupation()
        assert "kv_cache" in engine.released_tags
        del hog
    finally:
        engine.resume_memory_occupation()
    assert greedy(engine) == gpu.ref


@pytest.mark.gpu
def test_gpu_200_cycles_leave_free_memory_unchanged(gpu):
    engine = gpu.engine
    torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info()[0]
    for _ in range(200):
        engine.release_memory_occupation(keep_weights_backup=True)
        engine.resume_memory_occupation()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert abs(torch.cuda.mem_get_info()[0] - free0) <= 8 << 20
    assert greedy(engine) == gpu.ref
