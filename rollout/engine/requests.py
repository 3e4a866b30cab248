"""The one constructor of requests: a request id, its sequences (seeds, ids, prefix-cache salt) and the
`Request` the scheduler takes, for generate's prompts and for `Engine.score`'s sequences alike."""

from __future__ import annotations

import itertools
import random
from collections.abc import Hashable
from typing import Any

from rollout.sampling import SamplingParams
from rollout.state.sequence import Request, Scoring, Sequence


class RequestMaker:
    """Numbers sequences, draws their seeds from the engine's seeded generator, and salts their prefix
    cache with their LoRA adapter (`lora`: the LoraManager, or None when LoRA is off)."""

    def __init__(self, seed: int | None, lora: Any):
        self.rng = random.Random(seed)
        self.lora = lora
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()

    def new_id(self, kind: str) -> str:
        """An id for a request the engine adds itself (generate's, score's)."""
        return f"{kind}-{next(self._request_ids)}"

    def generate(
        self, request_id: Hashable, tokens: list[int], p: SamplingParams, text: str | None, stream: bool
    ) -> Request:
        """n samples of one prompt. The first one's prefill scores the prompt when prompt_logprobs asks;
        the other samples follow it and share its cached pages."""
        seeds = [self.rng.getrandbits(63) if p.seed is None else p.seed * 1_000_003 + i for i in range(p.n)]
        scored = [1 if i == 0 and p.prompt_logprobs is not None else None for i in range(p.n)]
        return self._request(request_id, tokens, p, [tokens] * p.n, seeds, scored, prompt=text, stream=stream)

    def score(self, token_lists: list[list[int]], starts: list[int], p: SamplingParams) -> Request:
        """Sequences that share their first starts[0] tokens, each scored from its own start, sampling
        nothing (`Engine.score`)."""
        prompt = token_lists[0][: starts[0]]
        samples, seeds = token_lists, [0] * len(token_lists)
        return self._request(self.new_id("score"), prompt, p, samples, seeds, starts, score_only=True)

    def _request(
        self,
        request_id: Hashable,
        prompt_ids: list[int],
        p: SamplingParams,
        samples: list[list[int]],
        seeds: list[int],
        logprobs_from: list[int | None],
        *,
        score_only: bool = False,
        prompt: str | None = None,
        stream: bool = False,
    ) -> Request:
        # an adapter's requests share cached pages only with each other
        salt = self.lora.salt(p.lora_name) if self.lora is not None else None
        seqs = [
            Sequence(
                next(self._seq_ids),
                request_id,
                sample,
                list(tokens),
                len(tokens),
                p,
                seed,
                scoring=None if start is None else Scoring(start, score_only),
                cache_salt=salt,
            )
            for sample, (tokens, seed, start) in enumerate(zip(samples, seeds, logprobs_from))
        ]
        return Request(request_id, list(prompt_ids), p, seqs, prompt=prompt, stream=stream)
