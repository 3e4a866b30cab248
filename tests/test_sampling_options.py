"""Sampling options (penalties, min_tokens, logit_bias, stop strings kept, processed logprobs), each
checked against a reference computed here in plain torch from the transformers model's logits."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from rollout import Engine, SamplingParams
from rollout.runner.logit_adjust import LogitAdjust
from rollout.runner.sampler import SamplingBatch, sample
from rollout.state.sequence import Sequence, uniforms

EOS = 2  # the toy tokenizer's <eos>
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
ROWS = 20000


def adjusted(logits: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams) -> torch.Tensor:
    """The reference logits pass: min_tokens mask, logit_bias, repetition, presence, frequency."""
    x = logits.clone()
    if len(out) < p.min_tokens:
        banned = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else {EOS})
        x[list(banned)] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(out):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] -= p.presence_penalty + p.frequency_penalty * out.count(t)
    return x


def truncated_logprobs(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """log of the distribution drawn from: softmax(x / T), top-k, top-p over the rest, min-p, renormalised."""
    probs = torch.softmax(x.double() / p.temperature, dim=-1)
    order = torch.argsort(-probs, stable=True)
    k = p.top_k if p.top_k > 0 else len(probs)
    kept = order[:k]
    mass = probs[kept] / probs[kept].sum()
    kept = kept[(torch.cumsum(mass, 0) - mass) < p.top_p]
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[kept] = True
    keep &= probs >= p.min_p * probs[kept].max()
    q = torch.where(keep, probs, 0.0)
    return torch.log(q / q.sum())


# -- the sampler alone --------------------------------------------------------------------------------
PENALISED = SamplingParams(
    temperature=0.8,
    top_k=6,
    repetition_penalty=1.7,
    presence_penalty=0.4,
    frequency_penalty=0.3,
    logit_bias={5: 1.2, 0: -0.5},
    logprobs_mode="processed",
)
PROMPT, OUT = [0, 4], [1, 1, 3, 6]


def sampler_rows(params: SamplingParams, rows: int, seed: int = 0):
    seqs = [Sequence(i, 0, 0, PROMPT + OUT, len(PROMPT), params, seed * rows + i) for i in range(rows)]
    sb = SamplingBatch.build([params] * rows, uniforms(seqs), len(LOGITS), torch.device("cpu"))
    if sb.adjusts_logits:
        sb.adjust = LogitAdjust.build(seqs, {EOS}, len(LOGITS), torch.device("cpu"))
    return sample(LOGITS.repeat(rows, 1), sb)


def test_penalised_distribution_matches_the_reference():
    res = sampler_rows(PENALISED, ROWS)
    lp = truncated_logprobs(adjusted(LOGITS, PROMPT, OUT, PENALISED), PENALISED)
    probs = lp.exp().numpy()
    counts = np.bincount(res.tokens.numpy(), minlength=len(LOGITS))
    assert counts[probs == 0].sum() == 0, "a truncated token was sampled"
    live = probs > 0
    assert chisquare(counts[live], probs[live] * ROWS).pvalue > 1e-3, (counts, probs * ROWS)
    # processed logprobs: under the distribution drawn from; finite for every sampled token
    torch.testing.assert_close(res.logprobs.double(), lp[res.tokens], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(res.logprobs).all()


def test_raw_logprobs_ignore_penalties_and_bias():
    raw = dataclasses.replace(PENALISED, logprobs_mode="raw")
    res = sampler_rows(raw, 16)
    full = torch.log_softmax(LOGITS / 0.8, dim=0)
    torch.testing.assert_close(res.logprobs, full[res.tokens])
    # the same draws as in processed mode: the mode only changes what is reported
    assert torch.equal(res.tokens, sampler_rows(PENALISED, 16).tokens)


# -- the engine against transformers ----------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(qwen3_dir):
    return Engine(qwen3_dir, page_size=4, max_total_tokens=4096, dtype="float32")


@pytest.fixture(scope="module")
def hf(qwen3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_last_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0, -1].float()


@torch.no_grad()
def hf_greedy_adjusted(hf, prompt: list[int], p: SamplingParams, n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(adjusted(hf_last_logits(hf, prompt + out), prompt, out, p).argmax()))
    return out


GREEDY_OPTIONS = [
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.7),
    dict(presence_penalty=0.8, frequency_penalty=0.5),
    dict(frequency_penalty=-0.3),
    dict(logit_bias={10: 4.0, 11: 3.0, 66: -5.0}),
    dict(repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.2, logit_bias={12: 0.3}),
]


@pytest.mark.parametrize("options", GREEDY_OPTIONS, ids=lambda o: "-".join(o))
def test_greedy_with_options_matches_transformers(engine, hf, options):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    p = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True, logprobs=True, **options)
    out = engine.generate(input_ids=[prompt], sampling_params=p)[0].outputs[0]
    want = hf_greedy_adjusted(hf, prompt, p, 16)
    assert out.token_ids == want
    assert want != hf_greedy_adjusted(hf, prompt, SamplingParams(temperature=0), 16), "option had no effect"
    # raw logprobs: plain log_softmax of the model's logits, before penalties and bias
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + want])).logits[0].float()
    raw = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1].gather(1, torch.tensor(want)[:, None])
    np.testing.assert_allclose(out.logprobs, raw.squeeze(1).numpy(), atol=1e-4)


def test_processed_logprobs_match_the_truncated_distribution(engine, hf):
    prompt = [20, 21, 22, 23]
    base = dict(
        temperature=0.8, top_k=12, top_p=0.9, repetition_penalty=1.4, frequency_penalty=0.2,
        max_new_tokens=12, ignore_eos=True, seed=3, logprobs=True,
    )  # fmt: skip
    p = SamplingParams(**base, logprobs_mode="processed")
    out = engine.generate(input_ids=[prompt], sampling_params=p)[0].outputs[0]
    raw = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(**base))[0].outputs[0]
    assert raw.token_ids == out.token_ids  # the mode changes what is reported, not what is drawn
    toks = out.token_ids
    for i, t in enumerate(toks):
        logits = hf_last_logits(hf, prompt + toks[:i])
        want = truncated_logprobs(adjusted(logits, prompt, toks[:i], p), p)[t].item()
        assert out.logprobs[i] == pytest.approx(want, abs=1e-4)
        assert raw.logprobs[i] == pytest.approx(torch.log_softmax(logits / 0.8, -1)[t].item(), abs=1e-4)
    assert not np.allclose(out.logprobs, raw.logprobs, atol=1e-3)


def test_processed_greedy_logprobs_are_of_the_adjusted_logits(engine, hf):
    prompt = [5, 6, 7]
    p = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, logprobs=True,
                       repetition_penalty=2.0, logprobs_mode="processed")  # fmt: skip
    out = engine.generate(input_ids=[prompt], sampling_params=p)[0].outputs[0]
    toks = out.token_ids
    for i, t in enumerate(toks):
        x = adjusted(hf_last_logits(hf, prompt + toks[:i]), prompt, toks[:i], p)
        assert out.logprobs[i] == pytest.approx(torch.log_softmax(x, -1)[t].item(), abs=1e-4)


# -- min_tokens and stop strings ----------------------------------------------------------------------
def test_min_tokens_masks_eos_and_stop_tokens(engine, hf):
    prompt = [5, 6, 7, 8]
    # a large EOS bias: without min_tokens the sample ends at once
    eager = dict(temperature=0, max_new_tokens=20, logit_bias={EOS: 30.0})
    first = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(**eager))[0].outputs[0]
    assert first.token_ids == [EOS] and first.finish_reason == "stop"
    p = SamplingParams(**eager, min_tokens=5)
    out = engine.generate(input_ids=[prompt], sampling_params=p)[0].outputs[0]
    assert out.token_ids == hf_greedy_adjusted(hf, prompt, p, 6) and out.token_ids[-1] == EOS
    assert len(out.token_ids) == 6 and EOS not in out.token_ids[:5] and out.finish_reason == "stop"
    # a stop token is held back the same way (EOS ignored, so only the stop token is masked)
    stop_tok = 30
    q = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True, stop_token_ids=[stop_tok],
                       logit_bias={stop_tok: 30.0}, min_tokens=3)  # fmt: skip
    out = engine.generate(input_ids=[prompt], sampling_params=q)[0].outputs[0]
    assert out.token_ids == hf_greedy_adjusted(hf, prompt, q, 4) and out.token_ids[3] == stop_tok
    assert len(out.token_ids) == 4 and out.stop_reason == stop_tok


def free_text(engine, prompt):
    p = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    return engine.generate(input_ids=[prompt], sampling_params=p)[0].outputs[0].text


def test_stop_string_before_min_tokens_does_not_end_the_sample(engine):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    text = free_text(engine, prompt)  # one character per token
    # a character seen early and again later
    c = next(ch for i, ch in enumerate(text[:8]) if text.find(ch, i + 3) >= 0)
    early = text.index(c)
    min_tokens = early + 2
    late = text.index(c, min_tokens - 1)  # the first occurrence checked once min_tokens are out
    p = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, stop=c, min_tokens=min_tokens)
    out = engine.generate(input_ids=[prompt], sampling_params=p)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == c
    assert out.text == text[:late] and len(out.token_ids) == late + 1
    plain = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, stop=c)
    assert engine.generate(input_ids=[prompt], sampling_params=plain)[0].outputs[0].text == text[:early]


def test_include_stop_str_in_output(engine):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    text = free_text(engine, prompt)
    stop = text[6:8]
    cut = text.find(stop)
    p = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, stop=stop,
                       include_stop_str_in_output=True)  # fmt: skip
    out = engine.generate(input_ids=[prompt], sampling_params=p)[0].outputs[0]
    assert out.text == text[: cut + len(stop)] and out.stop_reason == stop
    # streamed: the deltas add up to the same text
    engine.add_request("s", input_ids=prompt, sampling_params=p, stream=True)
    pieces = []
    while engine.has_unfinished():
        pieces += [o.outputs[0].text for o in engine.step() if o.request_id == "s"]
    assert "".join(pieces) == out.text


# -- seeded and batch-independent ---------------------------------------------------------------------
def test_options_are_seeded_and_batch_independent(engine):
    prompt = [5, 6, 7, 8, 9]
    p = SamplingParams(n=3, temperature=1.0, top_p=0.95, max_new_tokens=20, seed=11, logprobs=True,
                       repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2, min_tokens=8,
                       logit_bias={EOS: 2.0, 15: 1.0}, logprobs_mode="processed")  # fmt: skip
    alone = engine.generate(input_ids=[prompt], sampling_params=p)[0]
    others = [
        SamplingParams(n=2, temperature=1.2, max_new_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0.7, max_new_tokens=9, frequency_penalty=1.0, logit_bias={7: 3.0}),
        SamplingParams(temperature=0, max_new_tokens=14, repetition_penalty=2.0, min_tokens=3),
    ]
    crowded = engine.generate(
        input_ids=[[3, 4], prompt, list(range(40, 60)), [9, 9, 9]],
        sampling_params=[others[0], p, *others[1:]],
    )[1]
    ids = [c.token_ids for c in alone.outputs]
    assert ids == [c.token_ids for c in crowded.outputs]
    for a, b in zip(alone.outputs, crowded.outputs):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert len({tuple(t) for t in ids}) > 1
    assert all(len(t) >= 8 for t in ids)
    unbiased = SamplingParams(n=3, temperature=1.0, top_p=0.95, max_new_tokens=20, seed=11)
    assert [
        c.token_ids for c in engine.generate(input_ids=[prompt], sampling_params=unbiased)[0].outputs
    ] != ids


def test_default_batches_never_build_an_adjustment(engine, monkeypatch):
    def fail(*a, **k):
        raise AssertionError("LogitAdjust built for a batch that uses no option")

    monkeypatch.setattr(LogitAdjust, "build", fail)
    p = SamplingParams(temperature=0.9, top_k=5, max_new_tokens=6, seed=1, logprobs=True)
    engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=p)
    with pytest.raises(AssertionError, match="LogitAdjust"):
        engine.generate(input_ids=[[5, 6, 7]], sampling_params=SamplingParams(min_tokens=1))


# -- validation ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, field",
    [
        (dict(repetition_penalty=0.0), ValueError, "repetition_penalty"),
        (dict(repetition_penalty=-1.0), ValueError, "repetition_penalty"),
        (dict(repetition_penalty=float("nan")), ValueError, "repetition_penalty"),
        (dict(presence_penalty="1"), TypeError, "presence_penalty"),
        (dict(frequency_penalty=float("inf")), ValueError, "frequency_penalty"),
        (dict(min_tokens=-1), ValueError, "min_tokens"),
        (dict(min_tokens=1.5), TypeError, "min_tokens"),
        (dict(min_tokens=20, max_new_tokens=10), ValueError, "min_tokens"),
        (dict(logit_bias=[(1, 2.0)]), TypeError, "logit_bias"),
        (dict(logit_bias={"a": 1.0}), TypeError, "logit_bias"),
        (dict(logit_bias={-1: 1.0}), ValueError, "logit_bias"),
        (dict(logit_bias={1: float("nan")}), ValueError, "logit_bias"),
        (dict(include_stop_str_in_output=1), TypeError, "include_stop_str_in_output"),
        (dict(logprobs_mode="processed_logprobs"), ValueError, "logprobs_mode"),
    ],
)
def test_invalid_options_raise_naming_the_field(kwargs, error, field):
    with pytest.raises(error, match=field):
        SamplingParams(**kwargs)


def test_logit_bias_outside_the_vocabulary_is_refused(engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        engine.generate(input_ids=[[5, 6]], sampling_params=SamplingParams(logit_bias={vocab: 1.0}))
