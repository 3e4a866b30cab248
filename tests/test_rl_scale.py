"""The RL trainer at real shapes on a CPU: chunked logprobs against full logits (values, gradients, peak
memory) at a 151,936-token vocabulary, micro-batches against whole minibatches, and the loop's early
errors."""

from __future__ import annotations

import ctypes
import dataclasses
import sys

import pytest
import torch
from test_rl_parts import load_example
from transformers import AutoModelForCausalLM

from integrations.loop import (
    TrainerMemoryError,
    check_minibatches,
    check_trainer_fits,
    enable_gradient_checkpointing,
    encode_prompts,
    raise_with_oom_advice,
)
from integrations.metrics import benchmark_table, console_line
from integrations.rl import (
    RolloutBatch,
    TokenLogprobs,
    ValueHead,
    micro_batches,
    policy_logprobs,
    policy_logprobs_and_values,
    token_logprobs,
    trainer_autocast,
)
from integrations.tasks import Task
from rollout.models.toy import build_checkpoint, tiny_config

QWEN_VOCAB = 151936
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def make_batch(prompt_lens: list[int], lengths: list[int], vocab: int, seed: int = 0) -> RolloutBatch:
    """Random tokens, right-padded to the longest row; completions after each prompt."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    plen, lens = torch.tensor(prompt_lens), torch.tensor(lengths)
    at = torch.arange(T)
    attention = (at < lens[:, None]).long()
    completion = ((at >= plen[:, None]) & (at < lens[:, None])).float()
    return RolloutBatch(
        input_ids=torch.randint(3, vocab, (B, T), generator=g) * attention,
        attention_mask=attention,
        loss_mask=completion,
        old_logprobs=torch.zeros(B, T),
        prompt_lens=plen,
        completion_lens=lens - plen,
        group=torch.arange(B) // 2,
    )


def full_logits_reference(model, batch: RolloutBatch, weights: torch.Tensor, temperature: float = 1.0):
    """Row by row through model(...).logits: (logprobs on the completion tokens, parameter grads)."""
    model.zero_grad(set_to_none=True)
    rows = []
    for b in range(batch.input_ids.shape[0]):
        sub = batch.rows(torch.tensor([b]))
        logits = model(input_ids=sub.input_ids, attention_mask=sub.attention_mask).logits
        lp = token_logprobs(logits, sub.input_ids, temperature) * sub.loss_mask
        (lp * weights[b]).sum().backward()
        rows.append(lp.detach())
    return torch.cat(rows), grads(model)


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_grads_close(actual: dict, expected: dict, rel: float = 1e-5) -> float:
    assert actual.keys() == expected.keys()
    worst = 0.0
    for name, g in expected.items():
        err = ((actual[name] - g).abs().max() / g.abs().max().clamp(min=1e-30)).item()
        assert err <= rel, (name, err)
        worst = max(worst, err)
    return worst


# -- peak memory on a CPU: Linux's high-water mark of the resident set, reset before each measurement --
def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def peak_rss_growth(fn) -> tuple[object, int]:
    """fn()'s result and how far the resident set rose above its start while fn ran (VmHWM after
    `echo 5 > /proc/self/clear_refs`). glibc serves blocks of 1 MiB and more by mmap here, so a freed
    [chunk, V] block goes back to the OS and the high-water mark counts the live tensors, not the heap's
    fragmentation (glibc's own threshold adapts up to 32 MiB)."""
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = rss_bytes("VmRSS")
    out = fn()
    return out, rss_bytes("VmHWM") - start


class SavedBytes:
    """Bytes of the tensors autograd keeps from the forward for the backward (each storage once)."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


@pytest.fixture(scope="module")
def qwen_vocab_model():
    """One layer, hidden 64, Qwen's 151,936-token vocabulary, untied (the head has its own gradient)."""
    torch.manual_seed(0)
    cfg = tiny_config("qwen3", vocab_size=QWEN_VOCAB, num_hidden_layers=1, num_attention_heads=2)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads the peak resident set from Linux's /proc")
def test_chunked_logprobs_at_qwen_vocab_match_full_logits_in_bounded_memory(qwen_vocab_model):
    model = qwen_vocab_model
    batch = make_batch([100, 180, 40, 250], [512, 470, 300, 512], QWEN_VOCAB)
    B, T = batch.input_ids.shape
    full_bytes = B * T * QWEN_VOCAB * 4  # the [rows, T, V] float32 logits the old path held: 1.24 GB
    weights = torch.randn(B, T, generator=torch.Generator().manual_seed(1)) * batch.loss_mask
    policy_logprobs(model, batch.rows(torch.tensor([2])), chunk_tokens=64).sum().backward()  # warm-up
    model.zero_grad(set_to_none=True)

    saved = SavedBytes()

    def chunked():
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            lp = policy_logprobs(model, batch, chunk_tokens=32)
        (lp * weights).sum().backward()
        return lp.detach()

    ours, peak = peak_rss_growth(chunked)
    ours_grads = grads(model)
    (ref, ref_grads), ref_peak = peak_rss_growth(lambda: full_logits_reference(model, batch, weights))

    assert (ours - ref).abs().max().item() <= 1e-5
    assert (ours * (1 - batch.loss_mask)).abs().max().item() == 0  # 0 off the completion tokens
    worst = assert_grads_close(ours_grads, ref_grads)
    # the instrument sees logits: one row of the reference holds T x V float32 at least
    assert ref_peak > T * QWEN_VOCAB * 4, ref_peak
    assert peak < full_bytes / 4, (peak, full_bytes)
    assert saved.total < full_bytes / 16, (saved.total, full_bytes)
    print(
        f"\nfull logits {full_bytes / 1e6:.0f} MB; chunked peak RSS growth {peak / 1e6:.0f} MB, saved for "
        f"backward {saved.total / 1e6:.0f} MB; row-by-row reference peak {ref_peak / 1e6:.0f} MB; "
        f"max |logprob diff| {(ours - ref).abs().max().item():.1e}, worst relative grad diff {worst:.1e}"
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_chunked_logprobs_match_full_logits_tied(hf_models, temperature):
    """Tied embeddings (Qwen3 fixture), chunks of 3 tokens, each temperature: values and gradients."""
    model = hf_models["qwen3"]
    batch = make_batch([3, 5, 1], [20, 12, 17], model.config.vocab_size)
    weights = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(2)) * batch.loss_mask
    ref, ref_grads = full_logits_reference(model, batch, weights, temperature)
    ours = policy_logprobs(model, batch, temperature, chunk_tokens=3)
    (ours * weights).sum().backward()
    assert (ours.detach() - ref).abs().max().item() <= 1e-5
    assert_grads_close(grads(model), ref_grads)
    with torch.no_grad():  # no grad: no checkpoint, the same numbers
        assert torch.allclose(policy_logprobs(model, batch, temperature), ours.detach(), atol=1e-6)


def test_values_share_the_chunked_pass(hf_models):
    model = hf_models["qwen2"]
    critic = ValueHead(model.config.hidden_size)
    torch.nn.init.normal_(critic.proj.weight)
    batch = make_batch([2, 4], [9, 7], model.config.vocab_size)
    lp, values = policy_logprobs_and_values(model, critic, batch, chunk_tokens=2)
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
        ref = token_logprobs(out.logits, batch.input_ids) * batch.loss_mask
        ref_values = critic(out.hidden_states[-1])
    assert (lp.detach() - ref).abs().max().item() <= 1e-5
    assert torch.allclose(values[:, 1:].detach(), ref_values[:, :-1], atol=1e-5) and (values[:, 0] == 0).all()


def test_wrapped_policies_need_token_logprobs(hf_models):
    """DDP / FSDP2 must run their forward: a wrapped causal LM is refused with what to wrap instead."""
    model = hf_models["qwen3"]
    batch = make_batch([2], [6], model.config.vocab_size)
    wrapped = torch.nn.DataParallel(model)
    with pytest.raises(TypeError, match=r"wrap TokenLogprobs\(policy\)"):
        policy_logprobs(wrapped, batch)
    via_module = policy_logprobs(torch.nn.DataParallel(TokenLogprobs(model, chunk_tokens=2)), batch)
    assert torch.allclose(via_module, policy_logprobs(model, batch), atol=1e-6)


def test_bf16_autocast_runs_the_head_in_bf16(hf_models):
    model = hf_models["llama"]
    batch = make_batch([2, 3], [12, 9], model.config.vocab_size)
    with torch.no_grad():
        fp32 = policy_logprobs(model, batch)
        with trainer_autocast("bf16", "cpu"):
            bf16 = policy_logprobs(model, batch)
    assert bf16.dtype == torch.float32
    diff = (bf16 - fp32).abs().max().item()
    assert 1e-4 < diff < 0.5, diff  # bf16 rounding: present, small
    with pytest.raises(ValueError, match="autocast must be one of"):
        trainer_autocast("fp8", "cpu")


def test_gradient_checkpointing_keeps_grads_and_saves_less():
    def model_and_batch():
        torch.manual_seed(0)
        cfg = tiny_config("qwen3", num_hidden_layers=3)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        return model, make_batch([3, 4], [40, 33], cfg.vocab_size)

    results = []
    for checkpointing in (False, True):
        model, batch = model_and_batch()
        if checkpointing:
            enable_gradient_checkpointing(model)
        saved = SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            lp = policy_logprobs(model, batch)
        lp.sum().backward()
        results.append((grads(model), saved.total, model))
    (plain, plain_saved, _), (ckpt, ckpt_saved, model) = results
    assert_grads_close(ckpt, plain)
    assert ckpt_saved < plain_saved / 2, (ckpt_saved, plain_saved)
    # only the checkpointed modules are in training mode: attention and the rest keep dropout off
    on = [m for m in model.modules() if m.training]
    assert on and all(getattr(m, "gradient_checkpointing", False) for m in on)


# -- micro-batches ----------------------------------------------------------------------------------------
def test_micro_batches_by_padded_tokens():
    batch = make_batch([1] * 5, [10, 3, 8, 2, 9], vocab=50)
    rows = torch.tensor([0, 1, 2, 3, 4])
    # longest first (10, 9, 8, 3, 2): 2 x 10 = 20 fits, 3 x 10 does not; 2 x 8 fits, 3 x 8 does not
    assert [g.tolist() for g in micro_batches(batch, rows, max_tokens=20)] == [[0, 4], [2, 1], [3]]
    assert [g.tolist() for g in micro_batches(batch, rows, 4)] == [[0], [4], [2], [1], [3]]  # alone
    assert [g.tolist() for g in micro_batches(batch, rows, None)] == [rows.tolist()]
    for g in micro_batches(batch, rows, 20):
        lengths = (batch.prompt_lens + batch.completion_lens)[g]
        assert len(g) == 1 or len(g) * lengths.max() <= 20
    sub = batch.rows(torch.tensor([1, 3])).trimmed()
    assert sub.input_ids.shape == (2, 3) and sub.loss_mask.shape == (2, 3)
    with pytest.raises(ValueError, match="max_tokens"):
        micro_batches(batch, rows, 0)


def rollout_like(model, rows: int = 8, seed: int = 3) -> RolloutBatch:
    """Rows of different lengths whose old logprobs are the policy's own (ratio 1: nothing clipped)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 24, (rows,), generator=g).tolist()
    batch = make_batch([2 + i % 3 for i in range(rows)], lengths, model.config.vocab_size, seed)
    with torch.no_grad():
        batch.old_logprobs = policy_logprobs(model, batch) + 0.01 * torch.randn(
            batch.loss_mask.shape, generator=g
        )
    batch.old_logprobs *= batch.loss_mask
    return batch


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_micro_batch_gradient_equals_the_minibatch_gradient(hf_models, name):
    ex = load_example(name)
    model = hf_models["mistral"]
    batch = rollout_like(model)
    rows = torch.tensor([6, 1, 3, 0, 7, 2])
    critic = ValueHead(model.config.hidden_size)
    torch.nn.init.normal_(critic.proj.weight, std=0.1)
    g = torch.Generator().manual_seed(5)
    targets = [torch.randn(batch.loss_mask.shape, generator=g) for _ in range(3)]
    results = []
    for tokens in (None, 30):  # 30 padded tokens: one or two rows a forward
        cfg = ex.Config(batch=4, n=2, minibatches=1, micro_batch_tokens=tokens)
        assert tokens is None or len(micro_batches(batch, rows, tokens)) >= 3
        if name == "grpo":
            loss, stats = ex.minibatch_backward(model, batch, rows, torch.linspace(-1, 1, 8), cfg)
            losses = [loss]
        else:
            *losses, stats = ex.minibatch_backward(model, critic, batch, rows, ex.Targets(*targets), cfg)
            losses += [p.grad.clone() for p in critic.parameters()]
            critic.zero_grad(set_to_none=True)
        results.append((losses, stats, grads(model)))
    (whole, whole_stats, whole_grads), (split, split_stats, split_grads) = results
    assert_grads_close(split_grads, whole_grads)
    for a, b in zip(split, whole):
        assert torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=1e-5, atol=1e-7)
    assert split_stats.clip_fraction == pytest.approx(whole_stats.clip_fraction, abs=1e-6)
    assert split_stats.ratio_mean == pytest.approx(whole_stats.ratio_mean, rel=1e-6)


def test_grpo_update_keeps_the_optimizer_steps(hf_models):
    """epochs x minibatches optimizer steps a pass, however small the micro-batches."""
    grpo = load_example("grpo")
    model = hf_models["qwen2"]
    batch = rollout_like(model)
    for tokens in (None, 20):
        cfg = grpo.Config(batch=4, n=2, minibatches=2, epochs=2, micro_batch_tokens=tokens)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the shared fixture keeps its weights
        steps: list[int] = []
        opt.register_step_post_hook(lambda *_, seen=steps: seen.append(1))
        metrics = grpo.grpo_update(model, opt, batch, [0.1 * i for i in range(8)], cfg, torch.Generator())
        assert len(steps) == cfg.epochs * cfg.minibatches
        assert metrics["logprob_gap/max"] < 0.1  # the no-grad pass, micro-batched too
    model.zero_grad(set_to_none=True)


# -- the loop's edges --------------------------------------------------------------------------------
def no_digit_tokenizer():
    """A real fast tokenizer that knows letters only and drops what it does not know."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{c: 3 + i for i, c in enumerate("abcde")}}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def test_prompt_that_encodes_to_nothing_is_named():
    tok = no_digit_tokenizer()
    assert encode_prompts(tok, Task("copy").sample(3), "copy")  # letters: fine
    with pytest.raises(ValueError, match=r"turns the 'repeat' task's prompt '\d:' into no tokens.*--task"):
        encode_prompts(tok, Task("repeat").sample(3), "repeat")


def test_loop_refuses_a_task_its_tokenizer_cannot_encode(tmp_path):
    """Before the first step: the checkpoint's tokenizer turns the repeat task's prompts into nothing."""
    grpo = load_example("grpo")
    folder = build_checkpoint(tmp_path / "ckpt", "qwen3", tokenizer=False)
    no_digit_tokenizer().save_pretrained(str(folder))
    cfg = grpo.Config(model=str(folder), steps=1, batch=2, n=2, device="cpu", progress=False)
    with pytest.raises(ValueError, match="into no tokens"):
        grpo.train(cfg)
    assert len(grpo.train(dataclasses.replace(cfg, task="copy"))) == 1  # a task it covers runs


def test_minibatch_split_error_says_what_divides():
    divisors = r"use --minibatches in \[1, 2, 3, 4, 6, 12\]"
    with pytest.raises(ValueError, match=r"12 samples do not split evenly into minibatches=5: " + divisors):
        check_minibatches(12, 5)
    with pytest.raises(ValueError, match="micro_batch_tokens must be >= 1"):
        load_example("ppo").Config(micro_batch_tokens=0)
    with pytest.raises(ValueError, match="autocast must be one of"):
        load_example("grpo").Config(autocast="fp16")


def test_trainer_memory_errors_say_what_to_change():
    check_trainer_fits(10**9, free_bytes=10 * 2**30, releasable_bytes=4 * 2**30)  # 12 GB of 14: fits
    with pytest.raises(TrainerMemoryError, match=r"needs at least 11.2 GiB.*lower --mem-fraction"):
        check_trainer_fits(10**9, free_bytes=8 * 2**30, releasable_bytes=0)
    cfg = load_example("grpo").Config(micro_batch_tokens=8192, memory_saver=False)
    with pytest.raises(TrainerMemoryError, match=r"lower --micro-batch-tokens \(now 8192\).*"
                       r"--gradient-checkpointing.*--autocast bf16.*--memory-saver") as info:  # fmt: skip
        with raise_with_oom_advice(cfg):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 178.80 GiB")
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError) and "178.80 GiB" in str(info.value)
    with pytest.raises(ValueError, match="not memory"), raise_with_oom_advice(cfg):  # other errors pass
        raise ValueError("not memory")


def test_benchmark_table_and_console_formats():
    history = [
        {"step": 0, "time/train": 9.0, "logprob_gap/mean": 1.0},
        {"step": 1, "time/train": 1.0, "logprob_gap/mean": 0.01, "memory/train_peak_gb": 2.0},
        {"step": 2, "time/train": 2.0, "logprob_gap/mean": 0.03, "memory/train_peak_gb": 4.0},
    ]
    table = benchmark_table({"model": "m", "engine": "bfloat16"}, history).splitlines()
    assert table[0].startswith("| model | engine | mean len |") and "train s" in table[0]
    cells = table[2].strip("| ").split(" | ")
    assert cells[:2] == ["m", "bfloat16"] and "1.500" in cells and "3.00" in cells and "2.0e-02" in cells
    assert table[3] == "(means over steps 1-2)"
    line = console_line(0, {"logprob_gap/mean": 0.5}, {"logprob_gap/mean": "gap bf16 vs fp32 {:.1f}"})
    assert line == "step 0 | gap bf16 vs fp32 0.5"


# -- the examples at the real vocabulary, without tokenizer files -----------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_examples_at_qwen_vocab_with_the_scale_flags(tmp_path, name, capsys):
    """A scripts/models.py-style checkpoint (151,936 tokens, no tokenizer: the character one) through
    micro-batches, gradient checkpointing and bf16 autocast; the run ends with its benchmark row."""
    folder = build_checkpoint(
        tmp_path / "real-vocab", "qwen2", tokenizer=False, vocab_size=QWEN_VOCAB, tie_word_embeddings=True,
        num_hidden_layers=1, bos_token_id=151643, eos_token_id=151643,
    )  # fmt: skip
    ex = load_example(name)
    cfg = ex.Config(
        model=str(folder), steps=2, batch=2, n=2, max_new_tokens=12, minibatches=2, micro_batch_tokens=8,
        gradient_checkpointing=True, autocast="bf16", device="cpu", progress=False,
    )  # fmt: skip
    history = ex.train(cfg)
    assert len(history) == 2 and all(0 < h["logprob_gap/mean"] < 0.5 for h in history)  # bf16 trainer
    out = capsys.readouterr().out
    assert "gap float32 engine vs float32+bf16 autocast trainer" in out
    assert "| real-vocab | 2x2 | 12 | float32 | float32+bf16 autocast, grad ckpt | 8 |" in out


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_scale_flags_parse(name):
    ex = load_example(name)
    cfg = ex.parse_args(["--micro-batch-tokens", "4096", "--gradient-checkpointing", "--autocast", "bf16"])
    assert (cfg.micro_batch_tokens, cfg.gradient_checkpointing, cfg.autocast) == (4096, True, "bf16")
    assert ex.parse_args([]).micro_batch_tokens is None and ex.parse_args([]).autocast == "none"
