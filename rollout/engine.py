"""The engine: load a checkpoint, then generate with continuous batching over a paged KV cache."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from rollout.attention.registry import backend_class, resolve_backend_name
from rollout.cache.pages import PageManager
from rollout.cache.pool import KVPool
from rollout.config import EngineConfig
from rollout.distributed import agreement, make_tp_group
from rollout.memory import MemoryMixin, MemoryState, make_memory_saver
from rollout.models.config import ModelConfig
from rollout.models.registry import model_class
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.requests import check_lengths, check_prompts, normalize_params, normalize_prompts
from rollout.runner.graphs import GraphRunner
from rollout.runner.model_runner import ModelRunner, StepOutput
from rollout.sampling import SamplingParams
from rollout.scheduler import ScheduledBatch, Scheduler
from rollout.sequence import Sequence
from rollout.stop import check_finish
from rollout.weights.loader import load_checkpoint
from rollout.weights.updates import WeightsMixin

log = logging.getLogger("rollout")

CPU_DEFAULT_TOKENS = 32768
GPU_RESERVE_BYTES = 2 << 30  # activations, logits, sampling and graph buffers beside weights and KV


class Engine(MemoryMixin, WeightsMixin):
    def __init__(self, model: str | Path, *, tp_group: Any = None, **options: Any):
        """`tp_group`: a ProcessGroup or 1-D DeviceMesh to shard the model over (default: groups of
        `tp_size` consecutive ranks of the torch.distributed world). See rollout/distributed.py."""
        self.config = EngineConfig(model=model, **options)
        cfg = self.config
        self.device = cfg.torch_device
        self.model_config = ModelConfig.from_path(cfg.model)
        mc = self.model_config
        self.tp = tp = make_tp_group(
            cfg.tp_size, tp_group, device=self.device, timeout_s=cfg.tp_timeout, model_sizes=mc.tp_sizes
        )
        self.config = cfg = replace(cfg, tp_size=tp.size)
        self.dtype = cfg.torch_dtype(mc.torch_dtype)
        self.max_model_len = self._max_model_len()
        self.memory_saver = make_memory_saver(cfg.enable_memory_saver, self.device)
        self._memory = MemoryState()
        t0 = time.perf_counter()
        with self.memory_saver.region("weights"):
            self.model = model_class(mc.architecture)(
                mc, dtype=self.dtype, device=self.device, max_positions=self.max_model_len, tp=tp
            )
            load_checkpoint(self.model, cfg.model)
        self.tokenizer = _load_tokenizer(cfg.model)
        self.eos_ids = frozenset(mc.eos_token_ids or _tokenizer_eos(self.tokenizer))
        with self.memory_saver.region("kv_cache"):
            self.kv = self._make_kv_pool()
        self.pages = PageManager(self.kv.num_pages, cfg.page_size, cfg.enable_prefix_cache)
        self.scheduler = Scheduler(
            self.pages, max_running=cfg.max_running_requests, max_prefill_tokens=cfg.max_prefill_tokens
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
            max_model_len=self.max_model_len,
            max_running=cfg.max_running_requests,
        )
        if cfg.cuda_graph and self.device.type == "cuda" and backend.supports_cuda_graph:
            self.runner.graphs = self._capture_graphs(backend)
        self._rng = random.Random(cfg.seed)
        self._next_seq_id = 0
        self.weight_version = 0
        self.last_stats: dict[str, float] = {}
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
    def _max_model_len(self) -> int:
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
        page_bytes = KVPool.bytes_per_page(mc.num_layers, cfg.page_size, kv_heads, mc.head_dim, self.dtype)
        if cfg.max_total_tokens is not None:
            num_pages = -(-cfg.max_total_tokens // cfg.page_size)
        elif self.device.type == "cuda":
            # the engine's own share of the device (weights, KV, graphs), never more than is free now:
            # a trainer or another engine in the process may hold the rest
            free, total = torch.cuda.mem_get_info(self.device)
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())  # tied: once
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
        return KVPool(mc.num_layers, num_pages, cfg.page_size, kv_heads, mc.head_dim, self.dtype, self.device)

    def _capture_graphs(self, backend: Any) -> GraphRunner:
        cfg, mc = self.config, self.model_config
        graphs = GraphRunner(
            self.model,
            backend,
            max_bs=min(cfg.cuda_graph_max_bs or cfg.max_running_requests, cfg.max_running_requests),
            max_pages=-(-self.max_model_len // cfg.page_size),
            hidden_size=mc.hidden_size,
            dtype=self.dtype,
            device=self.device,
            capture_context=self.memory_saver.cuda_graph,  # tags the graph memory "cuda_graph"
        )
        graphs.capture()
        return graphs

    @property
    def pool_tokens(self) -> int:
        return self.kv.num_pages * self.kv.page_size

    # -- generation -------------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | list[str] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; one RequestOutput per prompt, in order."""
        with agreement(self.tp, "generate inputs") as agreed:  # a TP group runs one schedule
            token_lists, texts = normalize_prompts(prompts, input_ids, self.tokenizer)
            check_prompts(token_lists, self.model_config.vocab_size)
            params = normalize_params(sampling_params, len(token_lists))
            check_lengths(token_lists, params, self.max_model_len, self.pool_tokens)
            if self.tokenizer is None and any(p.stop_strings for p in params):
                raise ValueError("SamplingParams.stop needs a tokenizer, and the checkpoint has none")
            self._check_ready()
            agreed.propose(inputs=(token_lists, params), engine_state=self._schedule_state())
        groups = [self._make_group(i, tokens, p) for i, (tokens, p) in enumerate(zip(token_lists, params))]
        for group in groups:
            self.scheduler.add(group[0], group[1:])
        show = len(groups) > 1 if use_tqdm is None else use_tqdm
        self._run(sum(len(g) for g in groups), show)
        return [
            self._request_output(g, tokens, text)
            for g, tokens, text in zip(groups, token_lists, texts or [None] * len(groups))
        ]

    def _schedule_state(self) -> tuple:
        """What, besides the inputs, decides the schedule and the seeds (equal on the ranks of a group)."""
        return self._rng.getstate(), len(self.pages.index), self.pages.available(), self.kv.num_pages

    def _make_group(self, request: int, tokens: list[int], p: SamplingParams) -> list[Sequence]:
        seqs = []
        for sample in range(p.n):
            seed = self._rng.getrandbits(63) if p.seed is None else p.seed * 1_000_003 + sample
            seqs.append(Sequence(self._next_seq_id, request, sample, list(tokens), len(tokens), p, seed))
            self._next_seq_id += 1
        return seqs

    def _run(self, num_seqs: int, show: bool) -> None:
        bar = tqdm(total=num_seqs, desc="generate", unit="seq", disable=not show, dynamic_ncols=True)
        t0, stats = time.perf_counter(), {"prefill_tokens": 0, "decode_tokens": 0, "steps": 0}
        try:
            while (batch := self.scheduler.schedule()) is not None:
                out = self.runner.step(batch)
                done = self._postprocess(batch, out)
                stats["steps"] += 1
                stats["decode_tokens" if batch.decode else "prefill_tokens"] += batch.num_tokens
                if done:
                    bar.update(done)
                    elapsed = time.perf_counter() - t0
                    bar.set_postfix_str(f"{stats['decode_tokens'] / elapsed:.0f} tok/s", refresh=False)
        except BaseException:
            self.scheduler.abort_all()  # free every page so the engine stays usable
            raise
        finally:
            bar.close()
        stats["seconds"] = time.perf_counter() - t0
        stats["preemptions"] = self.scheduler.num_preemptions
        self.last_stats = stats

    def _postprocess(self, batch: ScheduledBatch, out: StepOutput | None) -> int:
        ready = self.scheduler.advance(batch)
        finished = 0
        for i, seq in enumerate(ready):
            seq.token_ids.append(out.tokens[i])
            if seq.params.logprobs:
                seq.logprobs.append(out.logprobs[i])
            if seq.params.top_logprobs:
                k = seq.params.top_logprobs
                seq.top_logprobs.append(dict(list(out.top[i].items())[:k]))
            if check_finish(seq, self.eos_ids, self.tokenizer):
                self.scheduler.finish(seq)
                finished += 1
        return finished

    def _request_output(self, group: list[Sequence], prompt: list[int], text: str | None) -> RequestOutput:
        outs = []
        for seq in group:
            p = seq.params
            if not isinstance(seq.stop_reason, str):  # a stop string already cut the text
                seq.text = self._decode(seq.output_ids, p.skip_special_tokens)
            outs.append(
                CompletionOutput(
                    index=seq.sample,
                    token_ids=seq.output_ids,
                    text=seq.text,
                    logprobs=list(seq.logprobs) if p.logprobs else None,
                    top_logprobs=list(seq.top_logprobs) if p.top_logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(prompt_token_ids=list(prompt), outputs=outs, prompt=text)

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special) if self.tokenizer else ""

    # -- cache ------------------------------------------------------------------------------------
    def flush_cache(self) -> None:
        """Drop the prefix cache (cached prompt pages); running requests are not affected."""
        self.pages.flush()


def _load_tokenizer(path: str) -> Any:
    folder = Path(path)
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _tokenizer_eos(tokenizer: Any) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return (eos,) if isinstance(eos, int) else ()
