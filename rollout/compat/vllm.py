"""An engine shaped like vLLM's offline `vllm.LLM`, enough for TRL's colocate mode and scripts written
for vLLM: `LLM`, `SamplingParams`, `LoRARequest`, `RequestOutput`, `CompletionOutput`, `Logprob`. See
docs/compat.md.

Names and shapes are translated here, then the one `rollout.Engine` is called.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout import outputs as native
from rollout.compat import with_graphs
from rollout.engine.engine import Engine
from rollout.sampling import SamplingParams as NativeParams

# vLLM's logprobs_mode -> the core's (vLLM's raw_logits / processed_logits have no counterpart)
LOGPROBS_MODES = {"raw_logprobs": "raw", "processed_logprobs": "processed"}


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely; exact inside the top-k, a lower bound outside it
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

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: None = None


@dataclass
class SamplingParams:
    """vLLM's names, passed through to the core's SamplingParams (validated when made).

    max_tokens=None: as far as the model allows, `max_model_len` minus the prompt (LLM.generate fills
    it in per prompt); `native` then holds a placeholder of max(min_tokens, 1)."""

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
    _native: NativeParams = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or self.logprobs < 0):
            raise ValueError(f"SamplingParams.logprobs must be None or an int >= 0, got {self.logprobs!r}")
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
            # the top list also gives the sampled token's rank when it is the most likely one
            top_logprobs=max(self.logprobs or 0, 1) if self.logprobs is not None else 0,
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


@dataclass
class LoRARequest:
    """vLLM's LoRARequest: a PEFT adapter folder, loaded under `lora_name` the first time a request
    names it. A later request with the same name and another `lora_int_id` reloads it from its path."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""


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
    # accepted, nothing to do: one process, Hugging Face checkpoints, our own model code
    "distributed_executor_backend": None,
    "trust_remote_code": None,
    "model_impl": None,
    "tokenizer": None,
    "enforce_eager": None,
    "max_cpu_loras": None,  # no host cache of adapters: one not loaded is read from its folder
}


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
        **kwargs: Any,
    ):
        unknown = sorted(set(kwargs) - set(LLM_ARGS))
        if unknown:
            raise TypeError(f"LLM() got unknown arguments {unknown}; known: {sorted(LLM_ARGS)}")
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} is not supported")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self.sleep_mode = bool(kwargs.get("enable_sleep_mode", False))
        options = {LLM_ARGS[k]: v for k, v in kwargs.items() if LLM_ARGS[k] is not None and v is not None}
        if kwargs.get("enforce_eager"):
            options["cuda_graph"] = False
        if options.get("dtype") == "half":
            options["dtype"] = "float16"
        if enable_lora:  # as in vLLM, the LoRA sizes count only with enable_lora
            options.update(max_loras=max_loras, max_lora_rank=max_lora_rank)
        self.engine = Engine(model, **options)
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
    ) -> list[RequestOutput]:
        """prompts: text, {"prompt_token_ids": [...]} / {"prompt": text} dicts, or a list of them.
        lora_request: one for every prompt, or a list of one (or None: the base model) per prompt."""
        items = prompts if isinstance(prompts, list) else [prompts]
        params = self._params(sampling_params, len(items))
        loras = self._lora_names(lora_request, len(items))
        unbounded = any(p.max_tokens is None for p in params)
        texts, ids = _split_prompts(items, self.engine.tokenizer, all_ids=unbounded)
        native_params = [
            self._native(p, lora, None if ids is None else len(i))
            for p, lora, i in zip(params, loras, ids or [None] * len(items))
        ]
        if ids is None:
            outs = self.engine.generate(texts, native_params, use_tqdm=use_tqdm)
        else:
            outs = self.engine.generate(input_ids=ids, sampling_params=native_params, use_tqdm=use_tqdm)
        return [self._output(o, p, t) for o, p, t in zip(outs, params, texts)]

    def _native(self, p: SamplingParams, lora_name: str | None, prompt_len: int | None) -> NativeParams:
        mode = LOGPROBS_MODES[self.logprobs_mode]
        changes: dict[str, Any] = {"logprobs_mode": mode, "lora_name": lora_name}
        if p.max_tokens is None:  # vLLM: up to the model's length
            room = self.engine.max_model_len - prompt_len
            if room < 1:
                raise ValueError(
                    f"prompt of {prompt_len} tokens leaves no room under max_model_len="
                    f"{self.engine.max_model_len}"
                )
            changes["max_new_tokens"] = room
        return dataclasses.replace(p.native, **changes)

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
        outs = self.engine.chat(messages, native_params, chat_template_kwargs, use_tqdm=use_tqdm)
        return [self._output(o, p, o.prompt) for o, p in zip(outs, params)]

    def _params(self, sp: Any, count: int) -> list[SamplingParams]:
        params = [sp or SamplingParams()] * count if not isinstance(sp, list) else sp
        if len(params) != count or not all(isinstance(p, SamplingParams) for p in params):
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
        )

    def _completion(self, c: native.CompletionOutput, p: SamplingParams) -> CompletionOutput:
        stop_reason = c.stop_reason
        if isinstance(stop_reason, int) and stop_reason not in (p.stop_token_ids or ()):
            stop_reason = None  # vLLM reports None for EOS
        logprobs = None
        if c.logprobs is not None:
            logprobs = [
                self._position(t, lp, top, p.logprobs)
                for t, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs)
            ]
        return CompletionOutput(
            index=c.index,
            text=c.text,
            token_ids=list(c.token_ids),
            cumulative_logprob=sum(c.logprobs) if c.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=stop_reason,
        )

    def _position(self, token: int, logprob: float, top: dict[int, float], k: int) -> dict[int, Logprob]:
        """vLLM's per-position dict: the top k by rank, plus the sampled token with its rank."""
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        entries = {t: Logprob(lp, r, self._decode(t)) for r, (t, lp) in enumerate(ranked[:k], start=1)}
        rank = next((r for r, (t, _) in enumerate(ranked, start=1) if t == token), len(ranked) + 1)
        entries.setdefault(token, Logprob(logprob, rank, self._decode(token)))
        return entries

    def _decode(self, token: int) -> str | None:
        tok = self.engine.tokenizer
        return None if tok is None else tok.decode([token])

    # -- weights and memory -----------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """What TRL colocate calls per tensor (through llm_engine...model.load_weights)."""
        named = list(weights)
        self.engine.update_weights_from_tensor(named)
        return {name for name, _ in named}

    def reset_prefix_cache(self) -> bool:
        self.engine.flush_cache()
        return True

    def sleep(self, level: int = 1) -> None:
        """Level 1 keeps a host copy of the weights and drops the KV cache; level 2 drops both (push
        new weights after waking)."""
        if not self.sleep_mode:
            raise RuntimeError("sleep needs LLM(..., enable_sleep_mode=True)")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self.engine.release_memory_occupation(keep_weights_backup=level == 1)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Resume "weights", "kv_cache" (and with it the decode graphs), or everything."""
        self.engine.resume_memory_occupation(with_graphs(tags, self.engine.released_tags))

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def shutdown(self) -> None:
        self.engine.shutdown()


class _LLMEngine:
    """`llm.llm_engine.model_config.max_model_len` and
    `llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights`."""

    def __init__(self, llm: LLM):
        self.model_config = _Namespace(max_model_len=llm.engine.max_model_len)
        model = _Namespace(load_weights=llm.load_weights)
        self.model_executor = _Namespace(driver_worker=_Namespace(model_runner=_Namespace(model=model)))

    def reset_prefix_cache(self) -> bool:
        return True


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
