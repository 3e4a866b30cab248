"""The engine: load a checkpoint, then generate with continuous batching over a paged KV cache.

The engine builds and owns its components and drives one step loop:
`add_request` queues, `step` runs schedule -> run -> postprocess once, `generate` loops over `step`.
Every public method takes one lock, so calls from several threads are serialised, never interleaved.

With `overlap_schedule`, `step` launches the next step before collecting the one in flight, so the
host prepares step k+1 while the device runs step k, and step k's tokens are reported one call late.
Every public method other than add_request / step / has_unfinished / token_deltas first collects the
step in flight (`_collect_in_flight`): weights, memory, adapters and aborts never change under a queued
step. See docs/architecture.md, "The step pipeline".
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from tqdm.auto import tqdm

from rollout.attention.registry import backend_class, resolve_backend_name
from rollout.cache.pages import PageManager
from rollout.cache.pool import KVPool
from rollout.cache.state import Snapshots, StatePool
from rollout.config import EngineConfig
from rollout.distributed import agreement, make_tp_group
from rollout.engine.inputs import (
    check_lengths,
    check_params,
    check_prompts,
    normalize_params,
    normalize_prompts,
)
from rollout.engine.results import request_output, token_deltas
from rollout.engine.scheduler import Scheduler
from rollout.engine.scoring import ScoreOutput, check_score_inputs, score_groups, score_output
from rollout.engine.stop import StopChecker
from rollout.lora import LoraManager
from rollout.memory import TAGS, MemoryManager, check_tags, make_memory_saver
from rollout.models.config import ModelConfig
from rollout.models.registry import model_class
from rollout.outputs import RequestOutput, TokenDelta
from rollout.runner.model_runner import Launched, ModelRunner
from rollout.sampling import SamplingParams
from rollout.state.scheduled import ScheduledBatch
from rollout.state.sequence import Request, Sequence
from rollout.weights import broadcast
from rollout.weights.loader import build_model, load_checkpoint
from rollout.weights.manager import WeightManager

log = logging.getLogger("rollout")

CPU_DEFAULT_TOKENS = 32768
GPU_RESERVE_BYTES = 2 << 30  # activations, logits, sampling and graph buffers beside weights and KV
F = TypeVar("F", bound=Callable[..., Any])


def serialised(fn: F | None = None, *, keeps_step_in_flight: bool = False) -> Any:
    """Run a public method under the engine's lock (re-entrant: generate calls step). Unless it
    `keeps_step_in_flight`, the step in flight is collected first: what the method reads or changes
    (weights, memory, adapters, requests' tokens) is then the state after every step launched."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def locked(self: Engine, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                if self._closed:
                    raise RuntimeError(f"{fn.__name__}: the engine was shut down")
                if not keeps_step_in_flight:
                    self._collect_in_flight()
                return fn(self, *args, **kwargs)

        return locked  # type: ignore[return-value]

    return wrap(fn) if fn is not None else wrap


@dataclass
class _InFlight:
    """A launched step not yet collected: its batch, its sampled rows' sequences (None: discarded), the
    runner's handle, and the weight version that computes it."""

    batch: ScheduledBatch
    rows: list[Sequence | None]
    launched: Launched
    weight_version: int


@dataclass(frozen=True)
class EngineStats:
    """A read-only snapshot of the engine's state (`Engine.stats`)."""

    requests: int  # in flight
    running: int  # sequences on the device
    waiting: int  # sequences queued (preempted ones included)
    pages_total: int
    pages_free: int  # free or held only by the prefix cache
    pages_cached: int  # pages indexed in the prefix cache
    page_size: int
    steps: int  # since the engine started
    prefill_steps: int  # of those steps (the others decode)
    prefill_tokens: int
    decode_tokens: int
    step_seconds: float  # host time inside step(): against the wall time, what the driving loop adds
    preemptions: int
    graph_steps: int  # decode steps replayed from a CUDA graph
    eager_steps: int
    weight_version: int
    released_tags: frozenset[str]


class Engine:
    def __init__(self, model: str | Path, *, tp_group: Any = None, **options: Any):
        """`tp_group`: a ProcessGroup or 1-D DeviceMesh to shard the model over (default: groups of
        `tp_size` consecutive ranks of the torch.distributed world). See rollout/distributed.py."""
        t0 = lap = time.perf_counter()
        self.start_seconds: dict[str, float] = {}  # by phase; scripts/bench_start.py prints them

        def done(phase: str) -> None:
            nonlocal lap
            self.start_seconds[phase], lap = time.perf_counter() - lap, time.perf_counter()

        self._lock = threading.RLock()
        self._closed = False
        self.config = cfg = EngineConfig(model=model, **options)
        self.device = cfg.torch_device
        self.model_config = mc = ModelConfig.from_path(cfg.model)
        self.tp = tp = make_tp_group(
            cfg.tp_size, tp_group, device=self.device, timeout_s=cfg.tp_timeout, model_sizes=mc.tp_sizes
        )
        self.config = cfg = replace(cfg, tp_size=tp.size)
        self.dtype = cfg.torch_dtype(mc.torch_dtype)
        self._max_model_len = self._check_max_model_len()
        saver = make_memory_saver(cfg.enable_memory_saver, self.device)
        done("config")
        with saver.region("weights"):
            self.model = build_model(
                model_class(mc.architecture),
                mc,
                dtype=self.dtype,
                device=self.device,
                max_positions=self._max_model_len,
                tp=tp,
            )
            done("model")
            load_checkpoint(self.model, cfg.model, fresh=True)
            done("weights")
        self.tokenizer = load_tokenizer(cfg.model)
        done("tokenizer")
        # adapter slots before the KV pool, which is sized from what is left
        self.lora = (
            LoraManager(self.model, cfg.max_loras, cfg.max_lora_rank, self.dtype, self.device, tp)
            if cfg.max_loras
            else None
        )
        eos_ids = frozenset(mc.eos_token_ids or _tokenizer_eos(self.tokenizer))
        # a model with per-request state (linear attention) declares it; it lives beside the KV pages
        self._state_shapes = self.model.state_shapes() if hasattr(self.model, "state_shapes") else None
        with saver.region("kv_cache"):
            self.kv = self._make_kv_pool()
            self.state = (
                StatePool(self._state_shapes, self._state_slots, self.device) if self._state_shapes else None
            )
        done("kv_cache")
        self.pages = PageManager(self.kv.num_pages, cfg.page_size, cfg.enable_prefix_cache)
        # a recurrent state cannot be cut at any cached page: prefixes are shared where it was kept
        snapshots = (
            Snapshots(self.pages, cfg.max_running_requests, self._state_slots - cfg.max_running_requests)
            if self.state is not None
            else None
        )
        self.scheduler = Scheduler(
            self.pages,
            StopChecker(eos_ids, self.tokenizer),
            max_running=cfg.max_running_requests,
            max_prefill_tokens=cfg.max_prefill_tokens,
            mixed=cfg.mixed_chunk,
            snapshots=snapshots,
        )
        self.backend_name = resolve_backend_name(cfg.attention_backend, self.device, self.dtype, mc.head_dim)
        backend = backend_class(self.backend_name)(
            self.kv, mc.num_heads // tp.size, mc.head_dim, mc.head_dim**-0.5
        )
        self.runner = ModelRunner(
            self.model,
            backend,
            mc.vocab_size,
            self.device,
            max_model_len=self._max_model_len,
            max_running=cfg.max_running_requests,
            lora=self.lora,
            eos_ids=eos_ids,
            state=self.state,
            state_slots=cfg.max_running_requests,
            snapshots=snapshots,
        )
        done("runner")  # scheduler, attention backend, model runner
        if cfg.cuda_graph and self.device.type == "cuda" and backend.supports_cuda_graph:
            max_bs = min(cfg.cuda_graph_max_bs or cfg.max_running_requests, cfg.max_running_requests)
            self.runner.capture_graphs(max_bs, mc.hidden_size, self.dtype, saver.cuda_graph)
        done("cuda_graphs")
        self.memory = MemoryManager(saver, self.device, self.model, self.kv, self.state)
        self.weights = WeightManager(self.model, mc, self.device, tp)
        self._rng = random.Random(cfg.seed)
        self._seq_ids = itertools.count()
        self._generate_ids = itertools.count()
        self._totals: dict[str, float] = dict.fromkeys(
            ("steps", "prefill_steps", "prefill_tokens", "decode_tokens", "step_seconds"), 0
        )
        self._aborted: list[Request] = []  # aborted by a release or an update, not yet reported
        self._overlap = cfg.overlap_schedule
        if self._overlap is None:  # tensor parallel with overlap has not run on GPUs yet: off there
            self._overlap = self.device.type == "cuda" and tp.size == 1
        self._in_flight: _InFlight | None = None
        self._collected: list[RequestOutput] = []  # from a step collected outside `step`, not yet reported
        self._last_stats: dict[str, float] = {}
        log.info(
            "loaded %s (%s, %s) on %s in %.1fs: KV pool %d tokens (%.2f GB), attention=%s",
            Path(cfg.model).name,
            mc.architecture,
            str(self.dtype).removeprefix("torch."),
            self.device,
            time.perf_counter() - t0,
            self.pool_tokens,
            self.kv.nbytes / 1e9,
            self.backend_name,
        )

    # -- set-up -----------------------------------------------------------------------------------
    def _check_max_model_len(self) -> int:
        mc, limit = self.model_config, self.config.max_model_len
        cap = mc.max_position_embeddings
        if mc.sliding_window:  # full attention equals sliding-window attention only inside the window
            cap = min(cap, mc.sliding_window)
        if limit is not None and limit > cap:
            raise ValueError(f"max_model_len={limit} exceeds what the model supports ({cap})")
        return limit or cap

    def _make_kv_pool(self) -> KVPool:
        cfg, mc = self.config, self.model_config
        kv_heads = self.tp.shard(mc.num_kv_heads, "num_key_value_heads")
        kv_layers = getattr(self.model, "num_kv_layers", mc.num_layers)  # hybrids: the attention layers
        page_bytes = KVPool.bytes_per_page(kv_layers, cfg.page_size, kv_heads, mc.head_dim, self.dtype)
        if cfg.max_total_tokens is not None:
            num_pages = -(-cfg.max_total_tokens // cfg.page_size)
        elif self.device.type == "cuda":
            # the engine's own share of the device (weights, KV, graphs), never more than is free now:
            # a trainer or another engine in the process may hold the rest
            free, total = torch.cuda.mem_get_info(self.device)
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())  # tied: once
            weights += self.lora.nbytes if self.lora is not None else 0
            if self._state_shapes:  # the state slots come out of the same budget as the pages
                weights += StatePool.bytes_per_slot(self._state_shapes) * (self._state_slots + 1)
            budget = min(total * cfg.mem_fraction - weights, free) - GPU_RESERVE_BYTES
            num_pages = int(budget // page_bytes) - 1  # the pool adds one scratch page
            if num_pages * cfg.page_size < 2 * cfg.page_size:
                raise ValueError(
                    f"mem_fraction={cfg.mem_fraction} leaves no room for a KV cache "
                    f"({weights / 2**30:.1f} GiB of weights, "
                    f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB)"
                )
        else:
            num_pages = CPU_DEFAULT_TOKENS // cfg.page_size
        num_pages = self.tp.min_int(num_pages)  # ranks of a group must schedule over equal pools
        return KVPool(kv_layers, num_pages, cfg.page_size, kv_heads, mc.head_dim, self.dtype, self.device)

    @property
    def _state_slots(self) -> int:
        """State slots: one per running request, and snapshots of shared prompts (cache/state.py): one per
        prompt whose samples wait for its prefill, a quarter of the running requests (n >= 4 per prompt)."""
        n = self.config.max_running_requests
        return n + max(4, n // 4)

    # -- facts ------------------------------------------------------------------------------------
    @property
    def pool_tokens(self) -> int:
        """Tokens the KV pool holds."""
        return self.kv.num_pages * self.kv.page_size

    @property
    def max_model_len(self) -> int:
        """The longest prompt + completion a request may have."""
        return self._max_model_len

    @property
    def weight_version(self) -> int:
        """Bumped by every successful weight update."""
        return self.weights.version

    @property
    def released_tags(self) -> frozenset[str]:
        """The memory tags released now."""
        return self.memory.released

    @property
    def last_stats(self) -> dict[str, float]:
        """The last generate call's steps, prefill and decode tokens, seconds and preemptions."""
        return dict(self._last_stats)

    @property
    def stats(self) -> EngineStats:
        """A snapshot of the requests, pages, steps and graph replays (read-only)."""
        sched, pages = self.scheduler, self.pages
        return EngineStats(
            requests=len(sched.requests),
            running=len(sched.running),
            waiting=len(sched.waiting),
            pages_total=pages.num_pages,
            pages_free=pages.available(),
            pages_cached=len(pages.index),
            page_size=pages.page_size,
            **self._totals,
            preemptions=sched.num_preemptions,
            graph_steps=self.runner.graph_steps,
            eager_steps=self.runner.eager_steps,
            weight_version=self.weights.version,
            released_tags=self.memory.released,
        )

    # -- requests ---------------------------------------------------------------------------------
    @serialised(keeps_step_in_flight=True)
    def add_request(
        self,
        request_id: Hashable,
        input_ids: list[int] | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        stream: bool = False,
    ) -> None:
        """Queue one prompt (token ids, or text with `prompt=`); `step` runs it. With `stream=True`,
        `step` reports every advance of it as a delta, otherwise only its end."""
        if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
            raise TypeError(f"request_id must be a str or an int, got {type(request_id).__name__}")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        if not isinstance(stream, bool):
            raise TypeError(f"stream must be a bool, got {type(stream).__name__}")
        with agreement(self.tp, "add_request inputs") as agreed:
            if input_ids is not None and (
                not isinstance(input_ids, list) or not all(not isinstance(t, list) for t in input_ids)
            ):
                raise TypeError("add_request: input_ids must be one list of token ids")
            tokens, texts, params = self._check_inputs(
                None if prompt is None else [prompt],
                None if input_ids is None else [input_ids],
                sampling_params,
            )
            agreed.propose(inputs=(request_id, tokens, params), engine_state=self._schedule_state())
        self._queue(request_id, tokens[0], params[0], texts[0] if texts else None, stream)

    @serialised(keeps_step_in_flight=True)
    def step(self) -> list[RequestOutput]:
        """Run one step of the batch; returns the requests it finished, deltas of streamed ones, and the
        requests a release or weight update aborted since the last step. With overlap_schedule, the
        step's results come back with the next call (the last ones with the call that finds no work)."""
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            self._totals["step_seconds"] += time.perf_counter() - t0

    def _step(self) -> list[RequestOutput]:
        reported = [request_output(r, self.tokenizer) for r in self._aborted] + self._collected
        self._aborted.clear()
        self._collected = []
        if self.scheduler.has_work():  # retracted requests may wait across a release: never run on it
            self._check_ready("step")
        batch = self.scheduler.schedule()
        if batch is None and self._in_flight is not None:  # what runs next depends on its results
            reported += self._collect()
            batch = self.scheduler.schedule()
        if batch is None:
            return reported
        if self._in_flight is not None and self._needs_host_tokens(batch):
            reported += self._collect()
        launched = self._launch(batch)
        if self._in_flight is not None:  # the device runs the new step while this one's tokens land
            reported += self._collect()
        rows = self.scheduler.account(batch, launched.sampled)
        self._in_flight = _InFlight(batch, rows, launched, self.weights.version)
        self._totals["steps"] += 1
        self._totals["prefill_steps"] += not batch.decode
        self._totals["decode_tokens"] += batch.decode_tokens
        self._totals["prefill_tokens"] += batch.num_tokens - batch.decode_tokens
        if not self._overlap or not self.scheduler.requests:  # nothing left for it to overlap with
            reported += self._collect()
        return reported

    def _launch(self, batch: ScheduledBatch) -> Launched:
        prev = self._in_flight.launched if self._in_flight is not None else None
        try:
            return self.runner.launch(batch, prev)
        except BaseException:
            self._abort_everything()  # a failed step leaves no request half-computed
            raise

    def _collect(self) -> list[RequestOutput]:
        """Wait for the step in flight and postprocess it; the outputs to report."""
        step, self._in_flight = self._in_flight, None
        try:
            out = step.launched.collect()
        except BaseException:
            self._abort_everything()
            raise
        touched = self.scheduler.postprocess(step.batch, step.rows, out, step.weight_version)
        return [request_output(r, self.tokenizer) for r in touched if r.stream or r.finished]

    def _collect_in_flight(self) -> None:
        """Collect the step in flight (if any) outside `step`: the next `step` reports its outputs."""
        if self._in_flight is not None:
            self._collected += self._collect()
        self.runner.reset()

    def _abort_everything(self) -> None:
        self._in_flight = None  # its queued work only writes pages that are freed now (stream order)
        self.scheduler.abort_all()

    def _needs_host_tokens(self, batch: ScheduledBatch) -> bool:
        """Whether building `batch` reads tokens the step in flight samples: min_tokens, logit_bias and
        penalties are built from each sequence's tokens on the host."""
        return any(s.pending and s.params.adjusts_logits for s in batch.seqs)

    @serialised
    def abort_request(self, request_id: Hashable) -> RequestOutput | None:
        """End a request in flight; its pages are freed at once. Returns its output so far (whole,
        finish_reason "abort"), or None when no such request is in flight."""
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        # the collected step's delta of it, if any, is superseded by the whole output
        self._collected = [o for o in self._collected if o.request_id != request_id]
        req.stream = False  # the abort reports the whole output
        return request_output(req, self.tokenizer)

    @serialised
    def retract_requests(self) -> int:
        """Take every running request off the device: its pages are freed and it waits to resume from
        its tokens, recomputing its KV (with the weights of then). Until the next step runs, weight
        updates and memory releases are allowed with these requests in flight. Returns the sequences
        retracted."""
        return self.scheduler.retract_all()

    @serialised(keeps_step_in_flight=True)
    def has_unfinished(self, request_id: Hashable | None = None) -> bool:
        """Whether requests are in flight (queued or running); with `request_id`, whether that one is."""
        if request_id is None:
            return bool(self.scheduler.requests)
        return request_id in self.scheduler.requests

    @serialised(keeps_step_in_flight=True)
    def token_deltas(self, sent: Mapping[Hashable, list[int]]) -> list[TokenDelta]:
        """For each request of `sent` still in flight, the tokens (logprobs, weight versions) its samples
        gained past `sent[request_id][sample]` output tokens, without text. A caller that streams at its
        own pace (the engine worker, between sends) reads this instead of step's streamed deltas, which
        are built, text included, on every step."""
        requests, deltas = self.scheduler.requests, []
        for rid, counts in sent.items():
            req = requests.get(rid)
            if req is not None:
                _check_sent_counts(rid, counts, len(req.seqs))
                deltas += token_deltas(req, counts)
        return deltas

    @serialised
    def generate(
        self,
        prompts: str | list[str] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        use_tqdm: bool | None = None,
        add_special_tokens: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; one RequestOutput per prompt, in order.

        `prompts` may be a tokenizer's BatchEncoding (its input_ids, padding dropped by its
        attention_mask). `add_special_tokens` is passed to the tokenizer for text prompts (None: the
        tokenizer's default; False for text that already holds them, such as a chat template's)."""
        if self.scheduler.requests:
            raise RuntimeError(
                "generate: requests added with add_request are in flight; run step() until "
                "has_unfinished() is False (or abort them) first"
            )
        if _is_encoding(prompts):
            if input_ids is not None:
                raise ValueError("pass exactly one of prompts (text) or input_ids (token ids)")
            prompts, input_ids = None, _encoding_ids(prompts)
        with agreement(self.tp, "generate inputs") as agreed:  # a TP group runs one schedule
            token_lists, texts, params = self._check_inputs(
                prompts, input_ids, sampling_params, add_special_tokens
            )
            agreed.propose(inputs=(token_lists, params), engine_state=self._schedule_state())
        ids = [f"generate-{next(self._generate_ids)}" for _ in token_lists]
        for rid, tokens, p, text in zip(ids, token_lists, params, texts or [None] * len(ids)):
            self._queue(rid, tokens, p, text, stream=False)
        show = len(ids) > 1 if use_tqdm is None else use_tqdm
        done = self._run_to_end(sum(p.n for p in params), show)
        return [done[rid] for rid in ids]

    @serialised
    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a list of
        them, each rendered by the tokenizer's chat template with the generation prompt added."""
        texts = [self._render_chat(conv, chat_template_kwargs) for conv in _conversations(messages)]
        # the template writes the special tokens itself (BOS included): encoding must not add more
        return self.generate(texts, sampling_params, use_tqdm=use_tqdm, add_special_tokens=False)

    def _render_chat(self, conversation: list[dict[str, Any]], kwargs: dict[str, Any] | None) -> str:
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer, and the checkpoint has none")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat: the tokenizer has no chat template (set tokenizer.chat_template)")
        options = {"add_generation_prompt": True, **(kwargs or {})}
        return self.tokenizer.apply_chat_template(conversation, tokenize=False, **options)

    def _run_to_end(self, num_seqs: int, show: bool) -> dict[Hashable, RequestOutput]:
        bar = tqdm(total=num_seqs, desc="generate", unit="seq", disable=not show, dynamic_ncols=True)
        t0, before = time.perf_counter(), (dict(self._totals), self.scheduler.num_preemptions)
        done: dict[Hashable, RequestOutput] = {}
        try:
            while self.scheduler.requests:
                for out in self.step():
                    done[out.request_id] = out
                    bar.update(len(out.outputs))
                    elapsed = time.perf_counter() - t0
                    tok_s = (self._totals["decode_tokens"] - before[0]["decode_tokens"]) / elapsed
                    bar.set_postfix_str(f"{tok_s:.0f} tok/s", refresh=False)
        except BaseException:
            self._abort_everything()  # free every page so the engine stays usable
            raise
        finally:
            bar.close()
        stats: dict[str, float] = {k: v - before[0][k] for k, v in self._totals.items()}
        stats["seconds"] = time.perf_counter() - t0
        stats["preemptions"] = self.scheduler.num_preemptions - before[1]
        self._last_stats = stats
        return done

    @serialised
    def score(
        self,
        prompts: str | list[str] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        start: int | list[int] | None = None,
        top_logprobs: int = 0,
        temperature: float = 1.0,
    ) -> list[ScoreOutput]:
        """The logprob of every token from `start` on (default 1: all but the first) of each sequence under
        the current weights, log_softmax(logits / temperature) as for sampled tokens (0: plain). Prefill
        only, through the paged KV cache: sequences whose first `start` tokens agree (a GRPO group) are
        one request, so their shared prompt is computed once. One ScoreOutput per sequence, in order."""
        if self.scheduler.requests:
            raise RuntimeError("score: requests added with add_request are in flight; finish them first")
        with agreement(self.tp, "score inputs") as agreed:
            token_lists, _ = normalize_prompts(prompts, input_ids, self.tokenizer)
            check_prompts(token_lists, self.model_config.vocab_size)
            starts = check_score_inputs(
                token_lists, start, top_logprobs, temperature, self._max_model_len, self.pool_tokens
            )
            params = SamplingParams(temperature=temperature, max_new_tokens=1, prompt_logprobs=top_logprobs)
            self._check_ready("cannot score")
            agreed.propose(inputs=(token_lists, starts, params), engine_state=self._schedule_state())
        groups = score_groups(token_lists, starts)
        seqs: list[Sequence] = [None] * len(token_lists)  # type: ignore[list-item]
        for members in groups:
            rid = f"score-{next(self._generate_ids)}"
            group = []
            for sample, i in enumerate(members):
                seq = Sequence(
                    next(self._seq_ids),
                    rid,
                    sample,
                    list(token_lists[i]),
                    len(token_lists[i]),
                    params,
                    0,
                    logprobs_from=starts[i],
                    score_only=True,
                )
                seqs[i] = seq
                group.append(seq)
            self.scheduler.add(Request(rid, token_lists[members[0]][: starts[members[0]]], params, group))
        self._run_to_end(len(seqs), show=False)
        return [score_output(s, top_logprobs) for s in seqs]

    def _check_inputs(
        self, prompts: Any, input_ids: Any, sampling_params: Any, add_special_tokens: bool | None = None
    ) -> tuple[list[list[int]], list[str] | None, list[SamplingParams]]:
        token_lists, texts = normalize_prompts(prompts, input_ids, self.tokenizer, add_special_tokens)
        check_prompts(token_lists, self.model_config.vocab_size)
        params = normalize_params(sampling_params, len(token_lists))
        check_params(params, self.model_config.vocab_size)
        self._check_lora_names(params)
        check_lengths(token_lists, params, self._max_model_len, self.pool_tokens)
        if self.tokenizer is None and any(p.stop_strings for p in params):
            raise ValueError("SamplingParams.stop needs a tokenizer, and the checkpoint has none")
        self._check_ready("cannot generate")
        return token_lists, texts, params

    def _check_lora_names(self, params: list[SamplingParams]) -> None:
        for p in params:
            if p.lora_name is not None and self.lora is None:
                raise ValueError(
                    f"SamplingParams.lora_name={p.lora_name!r}: LoRA is off "
                    "(start the engine with max_loras >= 1)"
                )
            if self.lora is not None:
                self.lora.check_name(p.lora_name)

    def _check_ready(self, action: str) -> None:
        """Raise instead of generating from released memory or discarded weights."""
        self.memory.check_resident(action)
        self.weights.check_valid(action)

    def _schedule_state(self) -> tuple:
        """What, besides the inputs, decides the schedule and the seeds (equal on the ranks of a group)."""
        return self._rng.getstate(), len(self.pages.index), self.pages.available(), self.kv.num_pages

    def _queue(
        self, request_id: Hashable, tokens: list[int], p: SamplingParams, text: str | None, stream: bool
    ) -> None:
        seqs = []
        for sample in range(p.n):
            seed = self._rng.getrandbits(63) if p.seed is None else p.seed * 1_000_003 + sample
            seqs.append(Sequence(next(self._seq_ids), request_id, sample, list(tokens), len(tokens), p, seed))
        if self.lora is not None:  # an adapter's requests share cached pages only with each other
            for seq in seqs:
                seq.cache_salt = self.lora.salt(p.lora_name)
        if p.prompt_logprobs is not None:  # the first sample's prefill scores the prompt; the rest share it
            seqs[0].logprobs_from = 1
        self.scheduler.add(Request(request_id, list(tokens), p, seqs, prompt=text, stream=stream))

    # -- memory -----------------------------------------------------------------------------------
    @serialised
    def release_memory_occupation(
        self,
        tags: str | Iterable[str] | None = None,
        *,
        abort: bool = False,
        keep_weights_backup: bool = False,
    ) -> None:
        """Give memory back to the device: "weights", "kv_cache", "cuda_graph" (None: all).

        Refuses while requests are in flight unless `abort=True` aborts them. The KV content and the
        prefix cache are dropped. Weights are discarded (the trainer pushes new ones before the next
        generate) unless `keep_weights_backup=True` keeps a host copy that resume restores.
        """
        wanted = check_tags(tags)
        self._drain("release_memory_occupation", abort)
        if "kv_cache" in wanted:
            self.pages.reset()  # the KV content goes, and with it every cached prefix
        releasing_weights = "weights" in wanted and "weights" not in self.memory.released
        self.memory.release(wanted, keep_weights_backup=keep_weights_backup)
        if releasing_weights and not keep_weights_backup:
            self.weights.discard()

    @serialised
    def resume_memory_occupation(self, tags: str | Iterable[str] | None = None) -> None:
        """Take released memory back (None: all). Resuming only "weights" first, updating them, then
        the rest keeps the peak low (staged wake)."""
        self.memory.resume(check_tags(tags))

    def _drain(self, action: str, abort: bool) -> None:
        """Refuse while requests are in flight (their KV would mix states), unless told to abort them.
        Retracted requests hold no KV: they pass, and recompute their KV when they resume."""
        if not self.scheduler.requests or self.scheduler.holds_no_kv():
            return
        if not abort:
            raise RuntimeError(
                f"{action}: requests are still in flight; let them finish, or pass abort=True to abort them"
            )
        aborted = self.scheduler.abort_all()
        for req in aborted:
            req.stream = False  # reported whole by the next step()
        self._aborted += aborted
        log.warning("%s aborted %d in-flight requests", action, len(aborted))

    # -- weights ----------------------------------------------------------------------------------
    @serialised
    def update_weights_from_tensor(
        self, named_tensors: Any, load_format: str | None = None, *, abort: bool = False
    ) -> int:
        """Load `named_tensors`: a list of (HF name, tensor), or with load_format="flattened_bucket" a
        FlattenedBucket (or SGLang's {"flattened_tensor", "metadata"} dict), or with
        load_format="direct" (name, tensor) pairs named and shaped as the engine stores its parameters
        (fused `qkv_proj` / `gate_up_proj`, this rank's shard). Returns tensors loaded."""
        if load_format == "direct":
            self._before_weight_update(abort)
            count = self.weights.load_direct(named_tensors)
            self.pages.flush()  # cached prefixes hold KV computed by the old weights
            return count
        return self._load(self.weights.unpack(named_tensors, load_format), abort)

    @serialised
    def update_weights_with_loader(
        self, loader: Callable[[torch.nn.Module, list], Any], named_tensors: Any, *, abort: bool = False
    ) -> None:
        """Call `loader(model, named_tensors)` to write the weights itself (SGLang's custom_weight_loader:
        the model is the engine's module, parameters by `named_parameters()`). The engine drains and
        flushes as for any update; validating what the loader writes is the loader's task."""
        self._before_weight_update(abort)
        self.weights.load_custom(loader, named_tensors)
        self.pages.flush()

    @serialised
    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[Any],
        shapes: list[Any],
        group_name: str,
        load_format: str | None = None,
        *,
        abort: bool = False,
    ) -> int:
        """Receive tensors broadcast by rank 0 of `group_name` (one per name, in order, or one flattened
        buffer), then load them; a bad set leaves the weights as they were."""
        return self._load(self.weights.receive(names, dtypes, shapes, group_name, load_format), abort)

    @serialised
    def update_weights_from_disk(
        self,
        model_path: str | Path,
        *,
        abort: bool = False,
        weight_name_filter: Callable[[str], bool] | list[str] | None = None,
    ) -> int:
        """Load the weights of a HF checkpoint folder with the same architecture and shapes: every one,
        or those `weight_name_filter` selects (a callable on the HF name, or a list of HF names; a
        partial checkpoint then suffices). Every header is validated before the first write."""
        self._before_weight_update(abort)
        count = self.weights.load_disk(model_path, weight_name_filter)
        self.pages.flush()  # cached prefixes hold KV computed by the old weights
        return count

    def _load(self, named: list[tuple[str, torch.Tensor]], abort: bool) -> int:
        self._before_weight_update(abort)
        count = self.weights.load(named)
        self.pages.flush()  # cached prefixes hold KV computed by the old weights
        return count

    def _before_weight_update(self, abort: bool) -> None:
        self.memory.check_weights_resident("updating weights")
        self._drain("updating weights", abort)

    @serialised
    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
        *,
        timeout: float = broadcast.DEFAULT_TIMEOUT_S,
    ) -> None:
        """Join a trainer's broadcast group as rank `rank_offset + tp rank`; blocks until all joined."""
        self.weights.join_group(
            master_address, master_port, rank_offset, world_size, group_name, backend, timeout
        )

    @serialised
    def destroy_weights_update_group(self, group_name: str) -> None:
        self.weights.leave_group(group_name)

    @serialised
    def get_weights_by_name(self, name: str, truncate_size: int | None = None) -> torch.Tensor:
        """A CPU copy of the weight as Hugging Face shapes it (fused q/k/v and gate/up split back out,
        tied embeddings answered for lm_head); `truncate_size` keeps the first rows only."""
        self.memory.check_weights_resident("get_weights_by_name")
        self.weights.check_valid("get_weights_by_name")
        return self.weights.read(name, truncate_size)

    @serialised
    def weights_checksum(self, names: list[str] | None = None) -> dict[str, int]:
        """Per HF name (None: every weight), a 64-bit checksum of the weight as Hugging Face shapes it,
        computed on the device (rollout/weights/checksum.py): equal for bit-identical tensors, changed
        by any single changed element. `integrations.verify_sync` compares it with the trainer's."""
        self.memory.check_weights_resident("weights_checksum")
        self.weights.check_valid("weights_checksum")
        return self.weights.checksums(names)

    @serialised
    def stored_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The model's parameters as the engine stores them: its own names (fused `qkv_proj`,
        `gate_up_proj`), dtype and this rank's shards, tied ones once. Views, not copies (SGLang's
        get_weights_checksum hashes these)."""
        self.memory.check_weights_resident("stored_weights")
        self.weights.check_valid("stored_weights")
        return list(self.model.named_parameters())

    # -- LoRA adapters ----------------------------------------------------------------------------
    @serialised
    def load_lora_adapter(
        self, name: str, path: str | Path, *, replace: bool = False, abort: bool = False
    ) -> None:
        """Load a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) under `name`;
        requests pick it with SamplingParams(lora_name=name). See `load_lora_adapter_from_tensors`."""
        lora = self._lora_manager("load_lora_adapter")
        self._load_lora(name, lambda: lora.load_folder(name, path, replace), abort)

    @serialised
    def load_lora_adapter_from_tensors(
        self,
        name: str,
        tensors: Any,
        config: Mapping[str, Any],
        *,
        replace: bool = False,
        abort: bool = False,
    ) -> None:
        """Load an adapter from PEFT state-dict names (`...q_proj.lora_A.weight`: a dict or a list of
        (name, tensor)) and its config (r, lora_alpha, target_modules, use_rslora). A name already loaded
        is refused unless `replace=True`, which copies the new tensors into its slot in place (a trainer's
        sync) and drops the pages its old version cached. Everything is validated before the first write:
        a refused adapter leaves the engine as it was. Requests on `name` in flight make a replace refuse
        unless `abort=True` aborts what is in flight."""
        lora = self._lora_manager("load_lora_adapter_from_tensors")
        self._load_lora(name, lambda: lora.load(name, tensors, config, replace), abort)

    @serialised
    def unload_lora_adapter(self, name: str, *, abort: bool = False) -> None:
        """Free the adapter's slot and its cached pages; later requests naming it are refused."""
        self._lora_manager("unload_lora_adapter")
        self._before_lora_write(name, abort)
        old = self.lora.salt(name) if name in self.lora.adapters else None
        self.lora.unload(name)
        self.pages.forget_salt(old)

    def _lora_manager(self, action: str) -> LoraManager:
        if self.lora is None:
            raise ValueError(f"{action}: LoRA is off; start the engine with max_loras >= 1")
        return self.lora

    def _before_lora_write(self, name: str, abort: bool) -> None:
        """Requests on `name` would mix the old and new adapter in their KV: refuse, or abort them all."""
        requests = self.scheduler.requests.values()
        if isinstance(name, str) and any(r.params.lora_name == name for r in requests):
            self._drain(f"LoRA adapter {name!r}", abort)

    def _load_lora(self, name: str, load: Callable[[], Any], abort: bool) -> None:
        self._before_lora_write(name, abort)
        old = self.lora.salt(name) if name in self.lora.adapters else None
        adapter = load()  # validates everything first: a refusal raises before any write
        if old is not None:  # pages the previous version computed must never be matched again
            self.pages.forget_salt(old)
        log.info("LoRA adapter %r loaded in slot %d (r=%d)", name, adapter.slot, adapter.config.rank)

    @serialised
    def flush_cache(self) -> None:
        """Drop the prefix cache (cached prompt pages); running requests are not affected."""
        self.pages.flush()

    # -- lifetime ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Abort what is in flight and give the device memory back (weights, KV cache, graphs); later
        calls raise. Safe to call twice. A process may also simply exit: it exits 0 either way."""
        with self._lock:
            if self._closed:
                return
            if self._in_flight is not None:  # its kernels read the weights and KV released below
                try:
                    self._in_flight.launched.collect()
                except Exception:  # a failed step: shutting down regardless
                    log.exception("shutdown: the step in flight failed")
            self._abort_everything()
            self.pages.reset()
            self.memory.release(list(TAGS), keep_weights_backup=False)
            self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def load_tokenizer(path: str) -> Any:
    folder = Path(path)
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _is_encoding(obj: Any) -> bool:
    """A tokenizer's BatchEncoding (or a plain dict shaped like one)."""
    return isinstance(obj, Mapping) and "input_ids" in obj


def _encoding_ids(enc: Mapping) -> list[list[int]]:
    ids = enc["input_ids"]
    ids = ids.tolist() if hasattr(ids, "tolist") else ids
    if ids and not isinstance(ids[0], (list, tuple)):
        ids = [ids]  # one unbatched prompt
    mask = enc.get("attention_mask")
    if mask is None:
        return [list(p) for p in ids]
    mask = mask.tolist() if hasattr(mask, "tolist") else mask
    if mask and not isinstance(mask[0], (list, tuple)):
        mask = [mask]
    return [[t for t, m in zip(p, row) if m] for p, row in zip(ids, mask)]  # padding out


def _is_conversation(obj: Any) -> bool:
    return isinstance(obj, (list, tuple)) and bool(obj) and all(isinstance(m, Mapping) for m in obj)


def _conversations(messages: Any) -> list[list[dict[str, Any]]]:
    if _is_conversation(messages):
        return [list(messages)]
    if isinstance(messages, (list, tuple)) and messages and all(_is_conversation(c) for c in messages):
        return [list(c) for c in messages]
    raise TypeError("messages must be a list of {'role', 'content'} dicts, or a non-empty list of such lists")


def _tokenizer_eos(tokenizer: Any) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return (eos,) if isinstance(eos, int) else ()


def _check_sent_counts(rid: Hashable, counts: Any, samples: int) -> None:
    """token_deltas' `sent[rid]`: one count of output tokens already sent per sample, each >= 0."""
    if not isinstance(counts, list) or len(counts) != samples:
        raise ValueError(f"sent[{rid!r}] must be a list of {samples} output-token counts, one per sample")
    # checked for every streamed request between two steps: a comprehension, cheaper than any(genexpr)
    if [c for c in counts if isinstance(c, bool) or not isinstance(c, int) or c < 0]:
        raise ValueError(f"sent[{rid!r}] holds a count that is not an int >= 0: {counts}")
