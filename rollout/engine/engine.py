"""The engine: load a checkpoint, then generate with continuous batching over a paged KV cache.

`Engine` builds and owns its components (sizing.py, the runner, the scheduler, the managers) and is
the public API: requests (here), memory, weights and adapters (trainer.py). `step` runs the pipeline
(pipeline.py: schedule -> launch -> collect, one step ahead with overlap); `generate` and every other
loop over it go through the step driver (driver.py). Every public method takes the engine's lock
(lock.py), and all but add_request / step / has_unfinished / token_deltas first collect the step in
flight: weights, memory, adapters and aborts never change under a queued step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from rollout.attention.registry import backend_class, resolve_backend_name
from rollout.cache.pages import PageManager
from rollout.config import EngineConfig
from rollout.distributed import agreement, make_tp_group
from rollout.engine.chat import conversations, load_tokenizer, render_chat, tokenizer_eos
from rollout.engine.driver import run_to_end
from rollout.engine.inputs import (
    check_inputs,
    check_prompts,
    check_sent_counts,
    encoding_ids,
    is_encoding,
    normalize_prompts,
)
from rollout.engine.lock import serialised
from rollout.engine.pipeline import StepPipeline
from rollout.engine.requests import RequestMaker
from rollout.engine.results import request_output, routed_experts, token_deltas
from rollout.engine.scheduler import Scheduler
from rollout.engine.scoring import ScoreOutput, check_score_inputs, score_groups, score_output
from rollout.engine.sizing import check_max_model_len, make_kv_pool, make_route_store, make_state_pool
from rollout.engine.stats import EngineStats, engine_stats
from rollout.engine.stop import StopChecker
from rollout.engine.trainer import TrainerMethods
from rollout.lora import LoraManager
from rollout.memory import TAGS, MemoryManager, make_memory_saver
from rollout.models.config import ModelConfig
from rollout.models.registry import model_class
from rollout.outputs import RequestOutput, TokenDelta
from rollout.runner.model_runner import ModelRunner
from rollout.runner.state_slots import Snapshots
from rollout.sampling import SamplingParams
from rollout.state.sequence import Sequence
from rollout.weights.loader import build_model, load_checkpoint
from rollout.weights.manager import WeightManager

log = logging.getLogger("rollout")


class Engine(TrainerMethods):
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
        self._max_model_len = check_max_model_len(mc, cfg.max_model_len)
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
        eos_ids = frozenset(mc.eos_token_ids or tokenizer_eos(self.tokenizer))
        with saver.region("kv_cache"):
            self.kv = make_kv_pool(cfg, mc, tp, self.device, self.dtype, self.model, self.lora)
            # a model with per-request state (linear attention) declares it; it lives beside the pages
            self.state = make_state_pool(cfg, self.model, self.device)
        self.routes = make_route_store(cfg, mc, self.kv, self.device)
        done("kv_cache")
        self.pages = PageManager(self.kv.num_pages, cfg.page_size, cfg.enable_prefix_cache)
        # a recurrent state cannot be cut at any cached page: prefixes are shared where it was kept
        snapshots = None
        if self.state is not None:
            running = cfg.max_running_requests
            snapshots = Snapshots(self.pages, running, self.state.num_slots - running)
        self.scheduler = Scheduler(
            self.pages,
            StopChecker(eos_ids, self.tokenizer),
            max_running=cfg.max_running_requests,
            max_prefill_tokens=cfg.max_prefill_tokens,
            mixed=cfg.mixed_chunk,
            routes=self.routes,
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
            routes=self.routes,
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
        self.request_maker = RequestMaker(cfg.seed, self.lora)
        overlap = cfg.overlap_schedule
        if overlap is None:  # tensor parallel with overlap has not run on GPUs yet: off there
            overlap = self.device.type == "cuda" and tp.size == 1
        self.pipeline = StepPipeline(
            self.scheduler,
            self.runner,
            self.tokenizer,
            overlap,
            weight_version=lambda: self.weights.version,
            check_ready=self._check_ready,
        )
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
    def weight_order(self) -> list[str]:
        """The HF names in the order their bytes lie in the weight storage: a trainer that packs a
        bucket in this order, in the engine's dtype, has it loaded as one copy per contiguous run."""
        return self.weights.storage_order()

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
        return engine_stats(self)

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
        text = texts[0] if texts else None
        self.scheduler.add(self.request_maker.generate(request_id, tokens[0], params[0], text, stream))

    @serialised(keeps_step_in_flight=True)
    def step(self) -> list[RequestOutput]:
        """Run one step of the batch; returns the requests it finished, deltas of streamed ones, and the
        requests a release or weight update aborted since the last step. With overlap_schedule, the
        step's results come back with the next call (the last ones with the call that finds no work)."""
        t0 = time.perf_counter()
        try:
            return self.pipeline.step()
        finally:
            self.pipeline.totals["step_seconds"] += time.perf_counter() - t0

    @serialised
    def abort_request(self, request_id: Hashable) -> RequestOutput | None:
        """End a request in flight; its pages are freed at once. Returns its output so far (whole,
        finish_reason "abort"), or None when no such request is in flight."""
        req = self.pipeline.abort(request_id)
        return None if req is None else request_output(req, self.tokenizer)

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
                check_sent_counts(rid, counts, len(req.seqs))
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
        if is_encoding(prompts):
            if input_ids is not None:
                raise ValueError("pass exactly one of prompts (text) or input_ids (token ids)")
            prompts, input_ids = None, encoding_ids(prompts)
        with agreement(self.tp, "generate inputs") as agreed:  # a TP group runs one schedule
            token_lists, texts, params = self._check_inputs(
                prompts, input_ids, sampling_params, add_special_tokens
            )
            agreed.propose(inputs=(token_lists, params), engine_state=self._schedule_state())
        ids = [self.request_maker.new_id("generate") for _ in token_lists]
        for rid, tokens, p, text in zip(ids, token_lists, params, texts or [None] * len(ids)):
            self.scheduler.add(self.request_maker.generate(rid, tokens, p, text, stream=False))
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
        texts = [render_chat(self.tokenizer, conv, chat_template_kwargs) for conv in conversations(messages)]
        # the template writes the special tokens itself (BOS included): encoding must not add more
        return self.generate(texts, sampling_params, use_tqdm=use_tqdm, add_special_tokens=False)

    def _run_to_end(self, num_seqs: int, show: bool) -> dict[Hashable, RequestOutput]:
        bar = tqdm(total=num_seqs, desc="generate", unit="seq", disable=not show, dynamic_ncols=True)
        totals = self.pipeline.totals
        t0, before = time.perf_counter(), (dict(totals), self.scheduler.num_preemptions)

        def progress(out: RequestOutput) -> None:
            bar.update(len(out.outputs))
            tok_s = (totals["decode_tokens"] - before[0]["decode_tokens"]) / (time.perf_counter() - t0)
            bar.set_postfix_str(f"{tok_s:.0f} tok/s", refresh=False)

        try:
            done = run_to_end(self, progress)
        except BaseException:
            self.pipeline.abort_everything()  # free every page so the engine stays usable
            raise
        finally:
            bar.close()
        stats: dict[str, float] = {k: v - before[0][k] for k, v in totals.items()}
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
            params = SamplingParams(
                temperature=temperature,
                max_new_tokens=1,
                prompt_logprobs=top_logprobs,
                return_routed_experts=self.routes is not None,  # scoring is the old-logprob pass
            )
            self._check_ready("cannot score")
            agreed.propose(inputs=(token_lists, starts, params), engine_state=self._schedule_state())
        seqs: list[Sequence] = [None] * len(token_lists)  # type: ignore[list-item]
        for members in score_groups(token_lists, starts):
            group = [token_lists[i] for i in members]
            req = self.request_maker.score(group, [starts[i] for i in members], params)
            for i, seq in zip(members, req.seqs):
                seqs[i] = seq
            self.scheduler.add(req)
        self._run_to_end(len(seqs), show=False)
        outs = [score_output(s, top_logprobs) for s in seqs]
        if self.routes is not None:
            for out, seq in zip(outs, seqs):
                out.routed_experts = routed_experts(seq)
        return outs

    def _check_inputs(
        self, prompts: Any, input_ids: Any, sampling_params: Any, add_special_tokens: bool | None = None
    ) -> tuple[list[list[int]], list[str] | None, list[SamplingParams]]:
        checked = check_inputs(
            prompts,
            input_ids,
            sampling_params,
            add_special_tokens,
            tokenizer=self.tokenizer,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self._max_model_len,
            pool_tokens=self.pool_tokens,
            lora=self.lora,
        )
        if self.routes is None and any(p.return_routed_experts for p in checked[2]):
            raise ValueError(
                "SamplingParams.return_routed_experts: this engine records no routes; start it with "
                "Engine(..., enable_return_routed_experts=True) (mixture-of-experts models only)"
            )
        self._check_ready("cannot generate")
        return checked

    def _check_ready(self, action: str) -> None:
        """Raise instead of generating from released memory or discarded weights."""
        self.memory.check_resident(action)
        self.weights.check_valid(action)

    def _schedule_state(self) -> tuple:
        """What, besides the inputs, decides the schedule and the seeds (equal on the ranks of a group)."""
        pages = self.pages
        return self.request_maker.rng.getstate(), len(pages.index), pages.available(), self.kv.num_pages

    # -- lifetime ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Abort what is in flight and give the device memory back (weights, KV cache, graphs); later
        calls raise. Safe to call twice. A process may also simply exit: it exits 0 either way."""
        with self._lock:
            if self._closed:
                return
            try:  # its kernels read the weights and KV released below
                self.pipeline.finish_in_flight()
            except Exception:  # a failed step: shutting down regardless
                log.exception("shutdown: the step in flight failed")
            self.pipeline.abort_everything()
            self.pages.reset()
            self.memory.release(list(TAGS), keep_weights_backup=False)
            self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
