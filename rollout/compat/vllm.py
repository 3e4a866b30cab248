"""An engine shaped like vLLM's offline `vllm.LLM`, enough for TRL's colocate mode and scripts written
for vLLM: `LLM`, `SamplingParams`, `LoRARequest`, `RequestOutput`, `CompletionOutput`, `Logprob`. See
docs/compat.md.

Names and shapes are translated here, then the one `rollout.Engine` is called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout import outputs as native
from rollout.compat import with_graphs
from rollout.compat.neutral import refuse
from rollout.compat.peer_args import VLLM_ENGINE_ARGS, VLLM_SAMPLING_PARAMS
from rollout.compat.vllm_worker import call, worker_class
from rollout.engine.engine import Engine
from rollout.sampling import SamplingParams as NativeParams

# vLLM's logprobs_mode -> the core's (vLLM's raw_logits / processed_logits have no counterpart)
LOGPROBS_MODES = {"raw_logprobs": "raw", "processed_logprobs": "processed"}


@dataclass
class Logprob:
    logprob: float
    # the token's place in the full distribution, from 1: tokens with a logprob >= its own (vLLM's)
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop_token_ids entry; None for EOS
    # LLM(enable_return_routed_experts=True) with an MoE model: int32 array [prompt + output tokens - 1,
    # MoE layers, top_k], the experts each MoE layer chose for each token
    routed_experts: Any = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    # with SamplingParams.prompt_logprobs: None for the first token, then {token: Logprob} per position
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class SamplingParams:
    """vLLM's names, passed through to the core's SamplingParams (validated when made).

    max_tokens=None: as far as the model allows, `max_model_len` minus the prompt (LLM.generate fills
    it in per prompt); `native` then holds a placeholder of max(min_tokens, 1). A given max_tokens is
    also cut to that room, as vLLM stops a request at max_model_len (finish_reason "length").

    Honoured besides the core's options: `allowed_token_ids`, `bad_words` (tokenized as vLLM does,
    with and without a leading space, when the LLM generates), `prompt_logprobs`, `detokenize=False`
    (no text; stop strings then refused, as vLLM refuses them), `best_of` equal to n (or None),
    `truncate_prompt_tokens` (keep the prompt's last k tokens). Every other name of vLLM's
    SamplingParams is accepted at its default and refused by name otherwise (`logits_processors`,
    structured outputs, ...)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # vLLM's default
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the sampled token plus the top k
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # no effect: fast tokenizers decode without it
    best_of: int | None = None
    detokenize: bool = True
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    logits_processors: list | None = None  # refused unless empty: the sampler runs no Python per row
    output_kind: Any = None  # the offline LLM reports final outputs only
    extra_args: dict | None = None  # vLLM's in-tree sampling reads none of it either
    structured_outputs: Any = None
    guided_decoding: Any = None
    flat_logprobs: bool = False
    logprob_token_ids: list[int] | None = None
    prompt_logprob_token_ids: list[int] | None = None
    prompt_logprob_start: int | None = None
    stream_interval: int | None = None
    thinking_token_budget: int | None = None
    repetition_detection: Any = None
    watermarking: Any = None
    skip_reading_prefix_cache: bool | None = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: Any = None
    skip_clone: bool = False
    output_text_buffer_length: int = 0
    _native: NativeParams = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or self.logprobs < 0):
            raise ValueError(f"SamplingParams.logprobs must be None or an int >= 0, got {self.logprobs!r}")
        self._check_vllm_only()
        max_new = self.max_tokens
        if max_new is None:  # a placeholder that passes validation, replaced per prompt by LLM.generate
            max_new = max(self.min_tokens, 1) if isinstance(self.min_tokens, int) else 1
        self._native = NativeParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=-1 if self.top_k in (0, -1) else self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            max_new_tokens=max_new,
            min_tokens=self.min_tokens,
            stop=self.stop or None,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
            # vLLM reports each token's rank (sampled and prompt tokens)
            logprob_ranks=self.logprobs is not None or self.prompt_logprobs is not None,
            prompt_logprobs=self.prompt_logprobs,
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def native(self) -> NativeParams:
        return self._native

    def _check_vllm_only(self) -> None:
        """vLLM's own checks (ValueError, as vLLM raises) and the neutral rule for what is not honoured."""
        if self.best_of is not None:
            if isinstance(self.best_of, bool) or not isinstance(self.best_of, int) or self.best_of < self.n:
                raise ValueError(
                    f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}."
                )
            if self.best_of != self.n:
                raise ValueError(
                    f"best_of={self.best_of} (> n={self.n}) is unsupported: the engine returns every sample"
                )
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool) or self.prompt_logprobs < 0
        ):
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if not self.detokenize and self.stop:
            raise ValueError(
                "stop strings are only supported when detokenize is True. Set detokenize=True to use stop."
            )
        if self.truncate_prompt_tokens is not None and (
            isinstance(self.truncate_prompt_tokens, bool)
            or not isinstance(self.truncate_prompt_tokens, int)
            or self.truncate_prompt_tokens < 1
        ):
            raise ValueError(f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}")
        if self.bad_words is not None and (
            isinstance(self.bad_words, str)
            or not all(isinstance(w, str) and w.strip() for w in self.bad_words)
        ):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        neutral = {name: getattr(self, name) for name in NEUTRAL_ONLY}
        refuse("SamplingParams", neutral, {**VLLM_SAMPLING_PARAMS, **OLD_SAMPLING_PARAMS}, "field")


@dataclass
class LoRARequest:
    """vLLM's LoRARequest: a PEFT adapter folder, loaded under `lora_name` the first time a request
    names it. A later request with the same name and another `lora_int_id` reloads it from its path."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""


# SamplingParams names of earlier vLLM releases, with their neutral values
OLD_SAMPLING_PARAMS = {"logits_processors": None, "guided_decoding": None}
# fields held only at a neutral value (refused by name otherwise)
NEUTRAL_ONLY = (
    "logits_processors",
    "structured_outputs",
    "guided_decoding",
    "flat_logprobs",
    "logprob_token_ids",
    "prompt_logprob_token_ids",
    "prompt_logprob_start",
    "stream_interval",
    "thinking_token_budget",
    "repetition_detection",
    "watermarking",
    "routed_experts_prompt_start",
    "trace_decode_token_ids",
)


# LLM(...) names -> engine options; names vLLM callers pass that have no effect here map to None
LLM_ARGS: dict[str, str | None] = {
    "dtype": "dtype",
    "seed": "seed",
    "gpu_memory_utilization": "mem_fraction",
    "tensor_parallel_size": "tp_size",
    "max_model_len": "max_model_len",
    "enable_prefix_caching": "enable_prefix_cache",
    "enable_sleep_mode": "enable_memory_saver",
    "max_num_seqs": "max_running_requests",
    "max_num_batched_tokens": "max_prefill_tokens",
    "block_size": "page_size",
    "device": "device",
    "enable_return_routed_experts": "enable_return_routed_experts",  # every request then gets its routes
    # accepted, nothing to do: one process, Hugging Face checkpoints, our own model code
    "distributed_executor_backend": None,
    "trust_remote_code": None,
    "model_impl": None,
    "tokenizer": None,
    "enforce_eager": None,
    "max_cpu_loras": None,  # no host cache of adapters: one not loaded is read from its folder
    "disable_log_stats": None,  # the engine logs no per-step stats
    "enable_chunked_prefill": None,  # prefill chunking is invisible in the outputs
    "disable_custom_all_reduce": None,
    "skip_tokenizer_init": None,  # outputs still carry text
    "swap_space": None,  # earlier vLLM: preempted requests are recomputed, never swapped
    "max_seq_len_to_capture": None,
    "tokenizer_mode": None,
    "served_model_name": None,
    "download_dir": None,
    "hf_token": None,
    "use_tqdm_on_load": None,
    "max_parallel_loading_workers": None,
}
# LLM-only names (not EngineArgs), accepted at their neutral values
LLM_ONLY = {
    "chat_template": None,
    "spec_method": None,
    "spec_model": None,
    "spec_tokens": None,
    "quantization_config": None,
    "enable_return_routed_experts": False,
    "return_sampling_mask": False,
}
# load_format values that read the folder's checkpoint (safetensors, else pytorch_model.bin)
LOAD_FORMATS = ("auto", "safetensors", "pt")


class LLM:
    def __init__(
        self,
        model: str,
        *,
        logprobs_mode: str = "raw_logprobs",
        quantization: Any = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_logprobs: int = 20,
        worker_extension_cls: str | type | None = None,
        load_format: str = "auto",
        scheduling_policy: str = "fcfs",
        **kwargs: Any,
    ):
        """vLLM's EngineArgs names: honoured ones translated (LLM_ARGS, above), every other accepted at
        its neutral value (vLLM's default) and refused by name otherwise; a name vLLM does not define
        raises TypeError."""
        rest = {k: v for k, v in kwargs.items() if k not in LLM_ARGS}
        refuse("LLM()", rest, {**VLLM_ENGINE_ARGS, **LLM_ONLY}, "arguments")
        if quantization is not None:
            raise ValueError(f"LLM(): quantization={quantization!r} is unsupported")
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"LLM(): load_format={load_format!r} unsupported; one of {LOAD_FORMATS}")
        if scheduling_policy != "fcfs":
            raise ValueError(
                f"LLM(): scheduling_policy={scheduling_policy!r} unsupported; the engine is fcfs"
            )
        self.max_logprobs = max_logprobs
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self.sleep_mode = bool(kwargs.get("enable_sleep_mode", False))
        honoured = {k: v for k, v in kwargs.items() if LLM_ARGS.get(k) is not None and v is not None}
        options = {LLM_ARGS[k]: v for k, v in honoured.items()}
        if kwargs.get("enforce_eager"):
            options["cuda_graph"] = False
        if options.get("dtype") == "half":
            options["dtype"] = "float16"
        if enable_lora:  # as in vLLM, the LoRA sizes count only with enable_lora
            options.update(max_loras=max_loras, max_lora_rank=max_lora_rank)
        self.engine = Engine(model, **options)
        self.worker = worker_class(worker_extension_cls)(self.engine)
        self.llm_engine = _LLMEngine(self)  # the attribute paths TRL's colocate mode reaches through
        self._ids = itertools.count()
        self._loras: dict[str, int] = {}  # adapters loaded from LoRARequests: name -> lora_int_id, LRU first

    # -- generation -------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        priority: int | list[int] | None = None,
        *,
        tokenization_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """prompts: text, {"prompt_token_ids": [...]} / {"prompt": text} dicts, or a list of them.
        lora_request: one for every prompt, or a list of one (or None: the base model) per prompt.
        priority: one int or one per prompt; the engine schedules first come, first served, as vLLM
        does under its default scheduling_policy="fcfs", where priorities are not read either.
        Every prompt is validated before any runs: a bad one raises and leaves nothing in flight."""
        items = prompts if isinstance(prompts, (list, tuple)) else [prompts]
        params = self._params(sampling_params, len(items))
        _check_priority(priority, len(items))
        refuse(
            "generate()",
            {"tokenization_kwargs": tokenization_kwargs, "mm_processor_kwargs": mm_processor_kwargs},
            {"tokenization_kwargs": None, "mm_processor_kwargs": None},
            "arguments",
        )
        loras = self._lora_names(lora_request, len(items))
        texts, ids = _split_prompts(items, self.engine.tokenizer, all_ids=True)
        ids = [i[-p.truncate_prompt_tokens :] if p.truncate_prompt_tokens else i for i, p in zip(ids, params)]
        native_params = [self._native(p, lora, len(i)) for p, lora, i in zip(params, loras, ids)]
        with _vllm_errors():
            outs = self.engine.generate(input_ids=ids, sampling_params=native_params, use_tqdm=use_tqdm)
        return [self._output(o, p, t) for o, p, t in zip(outs, params, texts)]

    def _native(self, p: SamplingParams, lora_name: str | None, prompt_len: int | None) -> NativeParams:
        mode = LOGPROBS_MODES[self.logprobs_mode]
        changes: dict[str, Any] = {"logprobs_mode": mode, "lora_name": lora_name}
        if self.engine.config.enable_return_routed_experts:
            changes["return_routed_experts"] = True
        self._check_max_logprobs(p)
        if prompt_len is not None:  # vLLM stops a request at max_model_len: fit max_tokens into it
            room = self._room(prompt_len)
            changes["max_new_tokens"] = room if p.max_tokens is None else min(p.max_tokens, room)
            changes["min_tokens"] = min(p.min_tokens, changes["max_new_tokens"])
        if p.bad_words:
            changes["bad_words_ids"] = _bad_words_ids(p.bad_words, self.engine.tokenizer)
        return dataclasses.replace(p.native, **changes)

    def _room(self, prompt_len: int) -> int:
        """Tokens a prompt leaves under max_model_len; vLLM's error when it leaves none."""
        limit = self.engine.max_model_len
        if prompt_len > limit:
            raise ValueError(
                f"The decoder prompt (length {prompt_len}) is longer than the maximum model length of "
                f"{limit}. Make sure that `max_model_len` is no smaller than the number of text tokens."
            )
        if prompt_len == limit:
            raise ValueError(
                f"The decoder prompt (length {prompt_len}) plus the number of requested output tokens "
                f"(at least 1) is longer than the maximum model length of {limit}. Make sure that "
                "`max_model_len` is no smaller than the number of text tokens (prompt + requested output "
                "tokens)."
            )
        return limit - prompt_len

    def _check_max_logprobs(self, p: SamplingParams) -> None:
        if self.max_logprobs == -1:
            return
        for what, k in (("sample", p.logprobs), ("prompt", p.prompt_logprobs)):
            if k is not None and k > self.max_logprobs:
                limit = self.max_logprobs
                raise ValueError(
                    f"Requested {what} logprobs of {k}, which is greater than max allowed: {limit}"
                )

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        batch = messages and isinstance(messages[0], (list, tuple))
        count = len(messages) if batch else 1
        params = self._params(sampling_params, count)
        if any(p.max_tokens is None for p in params):  # the rendered prompt's length is not known here
            raise ValueError("chat: max_tokens=None is not supported; give max_tokens")
        loras = self._lora_names(lora_request, count)
        native_params = [self._native(p, lora, None) for p, lora in zip(params, loras)]
        with _vllm_errors():
            outs = self.engine.chat(messages, native_params, chat_template_kwargs, use_tqdm=use_tqdm)
        return [self._output(o, p, o.prompt) for o, p in zip(outs, params)]

    def _params(self, sp: Any, count: int) -> list[SamplingParams]:
        params = [sp or SamplingParams()] * count if not isinstance(sp, (list, tuple)) else list(sp)
        if len(params) != count:  # vLLM's check and words
            raise ValueError(f"The lengths of prompts ({count}) and params ({len(params)}) must be the same.")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of {count} of them")
        for p in params:
            self._check_logprobs_mode(p)
        return params

    def _check_logprobs_mode(self, p: SamplingParams) -> None:
        """vLLM's raw_logprobs are log_softmax of the model's logits, before temperature; the core's raw
        ones are taken after temperature, so they agree only at T in {0, 1}. processed_logprobs (after
        penalties, bias, temperature and truncation) are the core's processed ones."""
        if p.logprobs is None or self.logprobs_mode == "processed_logprobs" or p.temperature in (0, 1):
            return
        raise ValueError(
            f"logprobs_mode='raw_logprobs' with temperature={p.temperature}: the core's raw logprobs are "
            "taken after temperature; use temperature 0 or 1, or logprobs_mode='processed_logprobs'"
        )

    # -- LoRA -------------------------------------------------------------------------------------
    def _lora_names(self, lora_request: Any, count: int) -> list[str | None]:
        """The adapter name of each prompt, loading the adapters it needs (vLLM loads on first use)."""
        requests = lora_request if isinstance(lora_request, list) else [lora_request] * count
        if len(requests) != count:
            raise ValueError(f"lora_request: {len(requests)} given for {count} prompts (one per prompt)")
        for r in requests:
            if r is not None and not all(hasattr(r, a) for a in ("lora_name", "lora_int_id", "lora_path")):
                raise TypeError(f"lora_request must be a LoRARequest or None, got {type(r).__name__}")
        wanted = {r.lora_name: r for r in requests if r is not None}
        if wanted and self.engine.lora is None:
            raise ValueError("lora_request: LoRA is off; build the LLM with enable_lora=True")
        if len(wanted) > self.engine.config.max_loras:
            raise ValueError(
                f"lora_request: {len(wanted)} adapters in one call, max_loras={self.engine.config.max_loras}"
            )
        for r in wanted.values():
            self._ensure_lora(r, keep=set(wanted))
        return [None if r is None else r.lora_name for r in requests]

    def _ensure_lora(self, r: LoRARequest, keep: set[str]) -> None:
        loaded = self._loras.pop(r.lora_name, None)
        if loaded != r.lora_int_id:
            if loaded is None and len(self.engine.lora.adapters) >= self.engine.config.max_loras:
                self._evict(keep)
            self.engine.load_lora_adapter(r.lora_name, r.lora_path, replace=loaded is not None)
        self._loras[r.lora_name] = r.lora_int_id  # now the most recently used

    def _evict(self, keep: set[str]) -> None:
        """Free the slot of the least recently used adapter this call does not need, as vLLM's LRU does."""
        victim = next((name for name in self._loras if name not in keep), None)
        if victim is None:
            raise ValueError(
                f"lora_request: all max_loras={self.engine.config.max_loras} slots hold adapters in use "
                f"({sorted(self.engine.lora.adapters)})"
            )
        self.engine.unload_lora_adapter(victim)
        del self._loras[victim]

    def _output(self, out: native.RequestOutput, p: SamplingParams, prompt: str | None) -> RequestOutput:
        return RequestOutput(
            request_id=str(next(self._ids)),
            prompt=prompt,
            prompt_token_ids=list(out.prompt_token_ids),
            outputs=[self._completion(c, p) for c in out.outputs],
            finished=out.finished,
            prompt_logprobs=self._prompt_logprobs(out, p),
        )

    def _prompt_logprobs(self, out: native.RequestOutput, p: SamplingParams) -> list | None:
        """vLLM's shape: None for the first prompt token, then {token: Logprob} with the prompt token
        (and its rank) and the top k."""
        if p.prompt_logprobs is None or out.prompt_logprobs is None:
            return None
        tops = out.prompt_top_logprobs or [{}] * len(out.prompt_logprobs)
        ranks = out.prompt_logprob_ranks or [None] * len(out.prompt_logprobs)
        positions: list[dict[int, Logprob] | None] = [None]
        for token, lp, top, rank in zip(out.prompt_token_ids[1:], out.prompt_logprobs, tops, ranks):
            positions.append(self._position(token, lp, top, p.prompt_logprobs, rank, p.detokenize))
        return positions

    def _completion(self, c: native.CompletionOutput, p: SamplingParams) -> CompletionOutput:
        stop_reason = c.stop_reason
        if isinstance(stop_reason, int) and stop_reason not in (p.stop_token_ids or ()):
            stop_reason = None  # vLLM reports None for EOS
        logprobs = None
        if c.logprobs is not None:
            tops = c.top_logprobs or [{}] * len(c.logprobs)
            ranks = c.logprob_ranks or [None] * len(c.logprobs)
            logprobs = [
                self._position(t, lp, top, p.logprobs, rank, p.detokenize)
                for t, lp, top, rank in zip(c.token_ids, c.logprobs, tops, ranks)
            ]
        return CompletionOutput(
            index=c.index,
            text=c.text if p.detokenize else "",
            token_ids=list(c.token_ids),
            cumulative_logprob=sum(c.logprobs) if c.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=stop_reason,
            routed_experts=None if c.routed_experts is None else c.routed_experts.numpy(),
        )

    def _position(
        self, token: int, logprob: float, top: dict[int, float], k: int, rank: int | None, text: bool
    ) -> dict[int, Logprob]:
        """vLLM's per-position dict: the token with its rank (the engine's count of tokens at least as
        likely), then the top k by rank."""
        ranked = sorted(top.items(), key=lambda kv: -kv[1])[:k]
        entries = {token: Logprob(logprob, rank, self._decode(token, text))}
        for r, (t, lp) in enumerate(ranked, start=1):
            entries.setdefault(t, Logprob(lp, r, self._decode(t, text)))
        return entries

    def _decode(self, token: int, text: bool = True) -> str | None:
        tok = self.engine.tokenizer
        return None if tok is None or not text else tok.decode([token])

    # -- weights and memory -----------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """What TRL colocate calls per tensor (through llm_engine...model.load_weights)."""
        with _vllm_errors():
            return self.worker.model_runner.model.load_weights(weights)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call a worker method by name (or a callable taking the worker) on this engine's one worker
        and answer the list of its one result (see rollout/compat/vllm_worker.py). It runs in this
        thread: `timeout` is not needed."""
        with _vllm_errors():
            return [call(self.worker, method, tuple(args), kwargs)]

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> list[Any]:
        """`func(model)` on the engine's model module (the engine's own parameter names)."""
        return [func(self.engine.model)]

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.engine.flush_cache()
        return True

    def sleep(self, level: int = 1, mode: str = "abort", reset_connector: bool = True) -> None:
        """Level 1 keeps a host copy of the weights and drops the KV cache; level 2 drops both (push
        new weights, or collective_rpc("reload_weights"), after waking). Nothing is in flight between
        offline calls, so every `mode` is the same here."""
        if not self.sleep_mode:
            raise RuntimeError("sleep needs LLM(..., enable_sleep_mode=True)")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self.engine.release_memory_occupation(keep_weights_backup=level == 1)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Resume "weights", "kv_cache" (and with it the decode graphs), or everything; whether the
        engine is fully awake."""
        self.engine.resume_memory_occupation(with_graphs(tags, self.engine.released_tags))
        return not self.engine.released_tags

    def is_sleeping(self) -> bool:
        return bool(self.engine.released_tags)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def shutdown(self) -> None:
        self.engine.shutdown()


class _LLMEngine:
    """`llm.llm_engine.model_config.max_model_len`,
    `llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights` (TRL's path),
    `get_num_unfinished_requests()` and `collective_rpc`."""

    def __init__(self, llm: LLM):
        self._llm = llm
        self.model_config = _Namespace(max_model_len=llm.engine.max_model_len)
        self.model_executor = _Namespace(driver_worker=llm.worker)

    def reset_prefix_cache(self, *args: Any) -> bool:
        return self._llm.reset_prefix_cache()

    def get_num_unfinished_requests(self) -> int:
        return self._llm.engine.stats.requests

    def has_unfinished_requests(self) -> bool:
        return self._llm.engine.has_unfinished()

    def collective_rpc(
        self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: Any = None
    ) -> list:
        return self._llm.collective_rpc(method, timeout, args, kwargs)


class _Namespace:
    def __init__(self, **kw: Any):
        self.__dict__.update(kw)


def _split_prompts(
    items: list, tokenizer: Any, all_ids: bool = False
) -> tuple[list[str | None], list[list[int]] | None]:
    """(texts, None) when every prompt is text (and `all_ids` is off), else (texts or None each, token
    ids of every prompt)."""
    texts: list[str | None] = []
    ids: list[list[int] | None] = []
    for item in items:
        if isinstance(item, str):
            texts.append(item)
            ids.append(None)
        elif isinstance(item, dict) and "prompt_token_ids" in item:
            texts.append(item.get("prompt"))
            ids.append(list(item["prompt_token_ids"]))
        elif isinstance(item, dict) and "prompt" in item:
            texts.append(item["prompt"])
            ids.append(None)
        else:
            raise TypeError("each prompt must be a str, {'prompt_token_ids': [...]} or {'prompt': str}")
    if all(i is None for i in ids) and not all_ids:
        return texts, None
    if any(i is None for i in ids) and tokenizer is None:
        raise ValueError("text prompts need a tokenizer, and the checkpoint has none")
    return texts, [i if i is not None else list(tokenizer.encode(t)) for i, t in zip(ids, texts)]


def _check_priority(priority: Any, count: int) -> None:
    if priority is None or (isinstance(priority, int) and not isinstance(priority, bool)):
        return
    if not isinstance(priority, (list, tuple)):
        raise TypeError(f"priority must be an int or a list of ints, got {type(priority).__name__}")
    if len(priority) != count:
        raise ValueError(f"The lengths of prompts ({count}) and priority ({len(priority)}) must be the same.")
    if not all(isinstance(p, int) and not isinstance(p, bool) for p in priority):
        raise TypeError(f"priority entries must be ints, got {priority!r}")


def _bad_words_ids(words: list[str], tokenizer: Any) -> list[list[int]]:
    """vLLM's tokenization of bad_words: each word as written (left-stripped), and with a leading space
    when that is another word token of the same length."""
    if tokenizer is None:
        raise ValueError("bad_words need a tokenizer, and the checkpoint has none")
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise ValueError(f"bad_words entry {word!r} tokenizes to no token")
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


# the engine's memory errors in vLLM's words: sleep() / wake_up() instead of release / resume
_HINTS = (
    (re.compile(r"resume_memory_occupation\(tags=\['weights'\]\)"), "wake_up(['weights'])"),
    (re.compile(r"resume_memory_occupation\(\)"), "wake_up()"),
    (re.compile(r"release_memory_occupation\(\)"), "sleep()"),
    (re.compile(r"release with keep_weights_backup=True"), "sleep(level=1) to keep them"),
    (re.compile(r"push new weights with update_weights_\*"), "load new weights (load_weights, or "
     "collective_rpc('reload_weights') for the checkpoint's)"),
)  # fmt: skip


@contextlib.contextmanager
def _vllm_errors() -> Iterator[None]:
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        for pattern, words in _HINTS:
            text = pattern.sub(words, text)
        if text == str(e):
            raise
        raise RuntimeError(text) from None
