"""An engine shaped like SGLang's offline `sglang.Engine`, so RL code written for it (verl, slime,
OpenRLHF) runs with only its import changed. See docs/compat.md.

Names and shapes are translated here, then the one `rollout.Engine` is called. As in SGLang, every
RL method (weights, groups, memory) answers `(success, message)` instead of raising: a bad payload,
path or group gives `(False, message)` and leaves the weights as they were (the core's loads are
all-or-nothing).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from dataclasses import replace
from typing import Any

import torch

from rollout.compat import with_graphs
from rollout.compat.neutral import refuse
from rollout.compat.peer_args import SGLANG_SAMPLING_PARAMS, SGLANG_SERVER_ARGS
from rollout.compat.serialize import (
    LocalSerializedTensor,
    MultiprocessingSerializer,
    deserialize_tensors,
    serialize_tensors,
)
from rollout.engine.driver import StepDriver
from rollout.engine.engine import Engine as CoreEngine
from rollout.memory import TAGS
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.sampling import SamplingParams
from rollout.weights.bucket import FlattenedBucket, parse_dtype

log = logging.getLogger("rollout.compat")
__all__ = [
    "Engine",
    "LocalSerializedTensor",
    "MultiprocessingSerializer",
    "deserialize_tensors",
    "serialize_tensors",
]

# SGLang ServerArgs name -> (engine option, translate value)
SERVER_ARGS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "device": ("device", lambda v: v),
    "dtype": ("dtype", lambda v: {"half": "float16", "float": "float32"}.get(v, v)),
    "mem_fraction_static": ("mem_fraction", lambda v: v),
    "max_total_tokens": ("max_total_tokens", lambda v: v),
    "random_seed": ("seed", lambda v: 0 if v is None else v),
    "tp_size": ("tp_size", lambda v: v),
    "max_running_requests": ("max_running_requests", lambda v: v),
    "context_length": ("max_model_len", lambda v: v),
    "disable_cuda_graph": ("cuda_graph", lambda v: not v),
    "attention_backend": ("attention_backend", lambda v: {None: "auto", "torch_native": "torch"}.get(v, v)),
    "enable_memory_saver": ("enable_memory_saver", lambda v: v),
    "page_size": ("page_size", lambda v: v),
    "disable_radix_cache": ("enable_prefix_cache", lambda v: not v),
    "enable_mixed_chunk": ("mixed_chunk", lambda v: v),
    "log_level": ("log_level", lambda v: v),
    "cuda_graph_max_bs": ("cuda_graph_max_bs", lambda v: v),
    "cuda_graph_max_bs_decode": ("cuda_graph_max_bs", lambda v: v),
    "max_prefill_tokens": ("max_prefill_tokens", lambda v: v),
}
# ServerArgs that change nothing this engine computes, accepted at any value: network and logging of
# SGLang's own server, remote code (the engine runs its own model code), the tokenizer process (outputs
# still carry text), and chunking of a prefill (invisible in the outputs)
IGNORED_SERVER_ARGS = frozenset(
    {
        "host",
        "port",
        "nccl_port",
        "api_key",
        "served_model_name",
        "log_requests",
        "log_requests_level",
        "enable_metrics",
        "show_time_cost",
        "decode_log_interval",
        "skip_server_warmup",
        "watchdog_timeout",
        "dist_timeout",
        "download_dir",
        "trust_remote_code",
        "skip_tokenizer_init",
        "enable_cache_report",
        "chunked_prefill_size",
        "gpu_id_step",
    }
)
# load_format at start: every one of these reads the folder's checkpoint (safetensors, else
# pytorch_model.bin); "dummy" too, since the trainer's first push overwrites the weights anyway
START_LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")

# SGLang sampling-param key -> SamplingParams field
SAMPLING_KEYS = {
    "max_new_tokens": "max_new_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "n": "n",
    "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "sampling_seed": "seed",
}
# LoRA ServerArgs, combined into the engine's max_loras / max_lora_rank (see _lora_options)
LORA_ARGS = ("enable_lora", "max_lora_rank", "max_loras_per_batch", "max_loaded_loras", "lora_paths")
DEFAULT_GROUP = "weight_update_group"
TOP_K_ALL = 1 << 30  # SGLang's top_k default: the whole vocabulary
GREEDY_BELOW = 1e-6  # SGLang samples greedily under this temperature
# sampling keys the engine cannot honour at a non-default value (constrained decoding, custom
# logit processors, stream pacing); refused by name
UNSUPPORTED_SAMPLING = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex", "custom_params")
# Engine.generate's arguments besides those in its signature, each accepted at its neutral value
GENERATE_NEUTRAL: dict[str, Any] = {
    "image_data": None,
    "audio_data": None,
    "video_data": None,
    "mm_hashes": None,
    "mm_content_hashes": None,
    "token_ids_logprob": None,
    "custom_logit_processor": None,
    "require_reasoning": False,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "routed_experts_start_len": 0,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "routed_dp_rank": None,
    "disagg_prefill_dp_rank": None,
    "data_parallel_rank": None,
    "external_trace_header": None,
    "rid": None,
    "session_params": None,
    "priority": None,
    "session_id": None,
    "cache_salt": None,
}


class Engine:
    """`Engine(model_path, **server_args)` with SGLang's ServerArgs names (see SERVER_ARGS)."""

    def __init__(self, model_path: str | None = None, **kwargs: Any):
        model_path = kwargs.pop("model", model_path)
        if model_path is None:
            raise TypeError("Engine() needs model_path")
        self._weights_backup = bool(kwargs.pop("enable_weights_cpu_backup", False))
        self._custom_loaders = _custom_loaders(kwargs.pop("custom_weight_loader", None))
        lora_args = {k: kwargs.pop(k) for k in LORA_ARGS if k in kwargs}
        options = _server_options(kwargs)
        adapters = _lora_paths(lora_args.get("lora_paths"))
        self.engine = CoreEngine(model_path, **options, **_lora_options(lora_args, len(adapters)))
        for name, path in adapters.items():
            self.engine.load_lora_adapter(name, path)
        self.tokenizer = self.engine.tokenizer
        self._version_label: str | None = None  # set by an update that names its weight_version
        self._groups: list[str] = []  # weights update groups joined, in order
        # streams share the engine's step loop: each step's outputs wait here for their own stream
        self._inbox: dict[str, list[RequestOutput]] = {}
        self._step_lock = threading.Lock()
        self._stream_ids = itertools.count()

    # -- generation -------------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        lora_path: str | list[str | None] | None = None,
        stream: bool = False,
        **neutral: Any,
    ) -> dict | list[dict] | Iterator[dict]:
        """SGLang's output dicts: one for a single prompt with n=1, else a list (prompt-major). With
        stream=True an iterator of cumulative chunks (batched ones carry their "index" in that order).
        lora_path: the name of a loaded adapter, for every prompt or one (or None) per prompt. SGLang's
        other arguments (multimodal data, hidden states, disaggregation, rid, priority, ...) are
        accepted at their neutral values (GENERATE_NEUTRAL) and refused by name otherwise."""
        refuse("generate()", neutral, GENERATE_NEUTRAL, "arguments")
        single = isinstance(prompt, str) or (
            input_ids is not None and len(input_ids) > 0 and not isinstance(input_ids[0], (list, tuple))
        )
        count = 1 if single else len(prompt if prompt is not None else input_ids or [])
        dicts = sampling_params if isinstance(sampling_params, list) else [sampling_params] * count
        loras = lora_path if isinstance(lora_path, list) else [lora_path] * count
        if len(loras) != count:
            raise ValueError(f"lora_path: {len(loras)} given for {count} prompts (one per prompt)")
        params = [
            to_sampling_params(d, return_logprob, top_logprobs_num, lora) for d, lora in zip(dicts, loras)
        ]
        if stream:
            texts = [prompt] if isinstance(prompt, str) else prompt
            ids = [input_ids] if single and input_ids is not None else input_ids
            return self._stream(texts, ids, params, indexed=not single or params[0].n > 1)
        outs = self.engine.generate(prompt, params, input_ids=input_ids, use_tqdm=False)
        result = [self._output(o, c) for o in outs for c in o.outputs]
        return result[0] if single and len(result) == 1 else result

    async def async_generate(self, *args: Any, stream: bool = False, **kwargs: Any) -> Any:
        """`generate` in a thread, keeping the event loop free (the engine's lock serialises). With
        stream=True, an async iterator of the chunks (`await` the call, then `async for`)."""
        if stream:
            return _async_chunks(self.generate(*args, stream=True, **kwargs))
        return await asyncio.to_thread(self.generate, *args, **kwargs)

    def _stream(
        self,
        texts: list[str] | None,
        ids: list[list[int]] | None,
        params: list[SamplingParams],
        indexed: bool,
    ) -> Iterator[dict]:
        """Queue the prompts as streamed requests, step the engine, and yield each sample's output so
        far whenever it grows. Closing the iterator early (or dropping it) aborts what is unfinished."""
        rids = [f"stream-{next(self._stream_ids)}" for _ in params]
        order = {key: i for i, key in enumerate((rid, j) for rid, p in zip(rids, params) for j in range(p.n))}
        so_far: dict[tuple[str, int], CompletionOutput] = {}
        live: set[str] = set()
        try:
            for i, (rid, p) in enumerate(zip(rids, params)):
                self._inbox[rid] = []
                text, tokens = None if texts is None else texts[i], None if ids is None else list(ids[i])
                self.engine.add_request(rid, tokens, p, prompt=text, stream=True)
                live.add(rid)
            while live:
                outs = self._step_for(live)
                if not outs:
                    return  # aborted by a direct engine call, which took their outputs
                for out in outs:
                    for c in out.outputs:
                        key = (out.request_id, c.index)
                        if not _advanced(so_far.get(key), c):
                            continue
                        so_far[key] = _merge(so_far.get(key), c)
                        chunk = self._output(out, so_far[key])
                        if indexed:
                            chunk["index"] = order[key]
                        yield chunk
                    if out.finished:
                        live.discard(out.request_id)
        finally:
            for rid in rids:
                self._inbox.pop(rid, None)
            for rid in live:
                self.engine.abort_request(rid)

    def _step_for(self, rids: set[str]) -> list[RequestOutput]:
        """Step the engine until one of `rids` has outputs and return theirs; other streams' outputs
        wait in their inboxes. Empty when the engine has nothing left to run."""
        with self._step_lock:
            StepDriver(self.engine, _Inboxes(self._inbox, rids)).run()
            ready = [out for r in rids for out in self._inbox[r]]
            for r in rids:
                self._inbox[r] = []
            return ready

    def _output(self, out: RequestOutput, c: CompletionOutput) -> dict:
        meta: dict[str, Any] = {
            "id": str(out.request_id),
            "finish_reason": finish_reason(c),
            "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": len(c.token_ids),
            "cached_tokens": 0,
            "weight_version": self.get_weight_version(),
        }
        if c.logprobs is not None:
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(c.logprobs, c.token_ids)]
        if c.top_logprobs is not None:
            meta["output_top_logprobs"] = [[(lp, t, None) for t, lp in top.items()] for top in c.top_logprobs]
        return {"text": c.text, "output_ids": list(c.token_ids), "meta_info": meta}

    # -- weights ----------------------------------------------------------------------------------
    def update_weights_from_tensor(
        self,
        named_tensors: Any,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> tuple[bool, str]:
        """(name, tensor | LocalSerializedTensor) pairs, or with load_format="flattened_bucket" one
        MultiprocessingSerializer payload per TP rank (bytes or base64) or a bucket dict. "direct": the
        pairs carry the engine's own parameter names (fused qkv_proj, gate_up_proj) and stored shapes.
        A name listed in custom_weight_loader ("module.function"): that function is called as
        `loader(model, named_tensors)`. The prefix cache is always flushed after a load (its KV came
        from the old weights), whatever flush_cache."""

        def run() -> str:
            if load_format == "flattened_bucket":
                bucket = self._bucket(named_tensors)
                if bucket is None:
                    return "empty bucket: nothing to load"
                count = self.engine.update_weights_from_tensor(bucket, load_format="flattened_bucket")
            elif load_format in (None, "direct"):
                count = self.engine.update_weights_from_tensor(self._named(named_tensors), load_format)
            elif load_format in self._custom_loaders:
                named = self._named(named_tensors)
                self.engine.update_weights_with_loader(_import_loader(load_format), named)
                return f"loaded {len(named)} tensors with {load_format}"
            else:
                raise ValueError(
                    f"load_format {load_format!r} is unknown: None, 'direct', 'flattened_bucket' or one of "
                    f"custom_weight_loader {list(self._custom_loaders)}"
                )
            return f"loaded {count} tensors"

        return self._rl("update_weights_from_tensor", run, weight_version)

    def _rank(self) -> int:
        return self.engine.tp.rank

    def _named(self, named_tensors: Any) -> list[tuple[str, torch.Tensor]]:
        if _is_payload_list(named_tensors):  # one serialized list of pairs per rank (SGLang's HTTP form)
            named_tensors = MultiprocessingSerializer.deserialize(_for_rank(named_tensors, self._rank()))
        if not isinstance(named_tensors, (list, tuple)):
            kind = type(named_tensors).__name__
            raise TypeError(f"named_tensors must be a list of (name, tensor) pairs, got {kind}")
        return [(name, self._tensor(t)) for name, t in named_tensors]

    def _tensor(self, t: Any) -> Any:
        if isinstance(t, LocalSerializedTensor) or (hasattr(t, "values") and hasattr(t, "get")):
            return t.get(self._rank())  # SGLang's own class has the same fields
        return t

    def _bucket(self, payload: Any) -> dict | FlattenedBucket | None:
        if _is_payload_list(payload):
            payload = MultiprocessingSerializer.deserialize(_for_rank(payload, self._rank()))
        if isinstance(payload, FlattenedBucket):
            return payload
        if not payload or (isinstance(payload, dict) and not payload.get("metadata")):
            return None  # an idle rank's empty bucket
        if not isinstance(payload, dict):
            raise TypeError(f"a flattened bucket must be a dict, got {type(payload).__name__}")
        return byte_layout(payload)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int | str,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP,
        backend: str = "nccl",
    ) -> tuple[bool, str]:
        def run() -> str:
            self.engine.init_weights_update_group(
                master_address, int(master_port), rank_offset, world_size, group_name, backend
            )
            self._groups.append(group_name)
            return f"joined weights update group {group_name!r}"

        return self._rl("init_weights_update_group", run)

    def update_weights_from_distributed(
        self,
        names: list[str] | str,
        dtypes: list[Any] | Any,
        shapes: list[Any] | Any,
        group_name: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> tuple[bool, str]:
        """One broadcast per name (or one flattened buffer); dtypes as torch dtypes or their names. A
        single name with its dtype and shape is taken as a list of one. Without group_name: the one
        group joined (whatever its name), else "weight_update_group"."""
        if isinstance(names, str):
            names, dtypes, shapes = [names], [dtypes], [shapes]
        group_name = self._default_group(group_name)

        def run() -> str:
            count = self.engine.update_weights_from_distributed(
                names, [parse_dtype(d) for d in dtypes], shapes, group_name, load_format
            )
            return f"loaded {count} tensors"

        return self._rl("update_weights_from_distributed", run, weight_version)

    def destroy_weights_update_group(self, group_name: str | None = None) -> tuple[bool, str]:
        """Without group_name: the one group joined, else "weight_update_group"."""
        group_name = self._default_group(group_name)

        def run() -> str:
            self.engine.destroy_weights_update_group(group_name)
            self._groups.remove(group_name)
            return f"left weights update group {group_name!r}"

        return self._rl("destroy_weights_update_group", run)

    def _default_group(self, group_name: str | None) -> str:
        if group_name is not None:
            return group_name
        return self._groups[0] if len(self._groups) == 1 else DEFAULT_GROUP

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, weight_version: str | None = None
    ) -> tuple[bool, str]:
        def run() -> str:
            if load_format not in (None, "auto", "safetensors", "pt"):
                raise ValueError(
                    f"load_format {load_format!r}: safetensors or pytorch_model.bin checkpoints load"
                )
            return f"loaded {self.engine.update_weights_from_disk(model_path)} tensors from {model_path}"

        return self._rl("update_weights_from_disk", run, weight_version)

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> tuple[bool, str]:
        """Load a PEFT adapter folder under `lora_name`, for generate(lora_path=lora_name). `pinned` is
        accepted: an adapter stays loaded until unloaded."""

        def run() -> str:
            self.engine.load_lora_adapter(lora_name, lora_path)
            return f"loaded LoRA adapter {lora_name!r}"

        return self._rl("load_lora_adapter", run)

    def unload_lora_adapter(self, lora_name: str) -> tuple[bool, str]:
        def run() -> str:
            self.engine.unload_lora_adapter(lora_name)
            return f"unloaded LoRA adapter {lora_name!r}"

        return self._rl("unload_lora_adapter", run)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The weight as float32 nested lists, first `truncate_size` rows (raises on an unknown name)."""
        return self.engine.get_weights_by_name(name, truncate_size).float().tolist()

    def get_weights_checksum(self) -> str:
        """SGLang's checksum: one SHA-256 hex string over the parameters as the engine stores them
        (its own names, sorted; each name's bytes, then the tensor's raw bytes). Equal for bit-identical
        weights; the native per-name `Engine.weights_checksum` hashes the Hugging Face tensors instead."""
        return sha256_checksum(self.engine.stored_weights())

    def get_weight_version(self) -> str:
        """The label the last update named, else the core's count of updates."""
        return self._version_label if self._version_label is not None else str(self.engine.weight_version)

    def _rl(self, action: str, run: Callable[[], str], version: str | None = None) -> tuple[bool, str]:
        try:
            message = run()
        except (ValueError, TypeError, RuntimeError, TimeoutError, OSError, KeyError) as e:
            log.warning("%s failed: %s", action, e)
            return False, f"{action} failed: {type(e).__name__}: {e}"
        if version is not None:
            self._version_label = str(version)
        return True, message

    # -- memory and lifecycle ---------------------------------------------------------------------
    def release_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
        """Raises RuntimeError for a tag already released, as SGLang's memory saver does (tags=None:
        when everything is)."""
        again = _tags(tags) & self.engine.released_tags
        if again and (tags is not None or again == set(TAGS)):
            raise RuntimeError(f"release_memory_occupation: {again} already released; resume them first")

        def run() -> str:
            self.engine.release_memory_occupation(tags, keep_weights_backup=self._weights_backup)
            return f"released {sorted(self.engine.released_tags)}"

        return self._rl("release_memory_occupation", run)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
        """Raises RuntimeError for a tag that is not released, as SGLang does (tags=None: when nothing
        is)."""
        held = _tags(tags) - self.engine.released_tags
        if held and (tags is not None or not self.engine.released_tags):
            raise RuntimeError(f"resume_memory_occupation: {held} not released; nothing to resume")

        def run() -> str:
            self.engine.resume_memory_occupation(with_graphs(tags, self.engine.released_tags))
            return f"resumed; still released: {sorted(self.engine.released_tags)}"

        return self._rl("resume_memory_occupation", run)

    def flush_cache(self) -> tuple[bool, str]:
        return self._rl("flush_cache", lambda: self.engine.flush_cache() or "flushed the prefix cache")

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


# -- translation ------------------------------------------------------------------------------------
def _tags(tags: str | list[str] | None) -> set[str]:
    if tags is None:
        return set(TAGS)
    return {tags} if isinstance(tags, str) else set(tags)


def sha256_checksum(named: list[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over (name, raw bytes) pairs sorted by name, as SGLang's weight checksum."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda nt: nt[0]):
        h.update(name.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _server_options(args: dict[str, Any]) -> dict[str, Any]:
    """SGLang's ServerArgs as engine options: honoured names translated, ignored ones dropped, every
    other name accepted at its neutral value and refused by name otherwise."""
    args = dict(args)
    load_format = args.pop("load_format", "auto")
    if load_format not in START_LOAD_FORMATS:
        raise ValueError(f"Engine(): load_format={load_format!r} unsupported; one of {START_LOAD_FORMATS}")
    gpu = args.pop("base_gpu_id", 0)
    if gpu not in (0, None):  # SGLang's first GPU of this engine
        if args.get("device") not in (None, "cuda"):
            raise ValueError(f"Engine(): base_gpu_id={gpu} needs device='cuda', got {args['device']!r}")
        args["device"] = f"cuda:{gpu}"
    rest = {k: v for k, v in args.items() if k not in SERVER_ARGS and k not in IGNORED_SERVER_ARGS}
    refuse("Engine()", rest, SGLANG_SERVER_ARGS, "server args")
    # None is SGLang's "decide for me": the engine's own default
    return {
        SERVER_ARGS[k][0]: SERVER_ARGS[k][1](v) for k, v in args.items() if k in SERVER_ARGS and v is not None
    }


def _custom_loaders(value: Any) -> tuple[str, ...]:
    """custom_weight_loader: the "module.function" paths that update_weights_from_tensor may name."""
    if value is None:
        return ()
    paths = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(p, str) and "." in p for p in paths):
        raise TypeError(f"custom_weight_loader must be a list of 'module.function' paths, got {value!r}")
    return tuple(paths)


def _import_loader(path: str) -> Callable[..., Any]:
    module, _, name = path.rpartition(".")
    try:
        loader = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"custom_weight_loader {path!r} cannot be imported: {e}") from None
    if not callable(loader):
        raise TypeError(f"custom_weight_loader {path!r} is not callable")
    return loader


def to_sampling_params(
    d: dict | None, return_logprob: bool, top_logprobs_num: int | None, lora_name: str | None = None
) -> SamplingParams:
    """SGLang's sampling-param dict as a SamplingParams. Every key of SGLang's SamplingParams is
    accepted; those the engine cannot honour (constrained decoding, custom params, stream pacing) only
    at their default, and refused by name otherwise. A key SGLang does not define raises ValueError."""
    d = dict(d or {})
    if d.get("stream_interval") == 1:  # every token: what the streams here do
        d.pop("stream_interval")
    # fast tokenizers (the engine's) decode without spaces_between_special_tokens: no effect on text
    d.pop("spaces_between_special_tokens", None)
    refuse(
        "sampling_params",
        {k: v for k, v in d.items() if k not in SAMPLING_KEYS},
        SGLANG_SAMPLING_PARAMS,
        "keys",
        unknown_error=ValueError,
    )
    fields = {SAMPLING_KEYS[k]: v for k, v in d.items() if k in SAMPLING_KEYS and v is not None}
    if "top_k" in fields and (fields["top_k"] <= 0 or fields["top_k"] >= TOP_K_ALL):
        fields["top_k"] = -1  # SGLang's "off"
    if isinstance(fields.get("temperature"), (int, float)) and 0 < fields["temperature"] < GREEDY_BELOW:
        fields["temperature"] = 0  # SGLang samples greedily there
    if isinstance(fields.get("logit_bias"), dict):  # SGLang keys it by str(token id), the core by int
        fields["logit_bias"] = {_token_id(k): v for k, v in fields["logit_bias"].items()}
    return SamplingParams(
        **fields, logprobs=return_logprob, top_logprobs=top_logprobs_num or 0, lora_name=lora_name
    )


def _token_id(key: Any) -> Any:
    # anything but a number in a str is left as it is, for the core to refuse naming logit_bias
    return int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else key


def _advanced(before: CompletionOutput | None, delta: CompletionOutput) -> bool:
    """Whether a streamed sample gained output or ended (a step reports every sample of a request)."""
    ended_now = delta.finish_reason is not None and (before is None or before.finish_reason is None)
    return bool(delta.token_ids or delta.text) or ended_now


def _merge(before: CompletionOutput | None, delta: CompletionOutput) -> CompletionOutput:
    """A streamed sample's output so far plus its newest delta. An abort reports the whole output, so
    it replaces what came before."""
    if before is None or delta.finish_reason == "abort":
        return delta
    return replace(
        delta,
        token_ids=before.token_ids + delta.token_ids,
        text=before.text + delta.text,
        logprobs=None if delta.logprobs is None else before.logprobs + delta.logprobs,
        top_logprobs=None if delta.top_logprobs is None else before.top_logprobs + delta.top_logprobs,
        weight_versions=before.weight_versions + delta.weight_versions,
    )


async def _async_chunks(chunks: Iterator[dict]) -> AsyncIterator[dict]:
    """The chunks of a sync stream, each computed in a thread so the event loop stays free. The lock
    keeps a close (on cancellation or aclose) from running while a thread is inside the stream."""
    lock, end = threading.Lock(), object()

    def pull() -> Any:
        with lock:
            return next(chunks, end)

    try:
        while (chunk := await asyncio.to_thread(pull)) is not end:
            yield chunk
    finally:
        with lock:
            chunks.close()  # aborts what is unfinished


def _lora_paths(paths: Any) -> dict[str, str]:
    """SGLang's lora_paths: {name: path}, or a list of "name=path", "path" (named by itself) or
    {"lora_name", "lora_path"} dicts."""
    if not paths:
        return {}
    if isinstance(paths, dict):
        return dict(paths)
    adapters = {}
    for entry in paths:
        if isinstance(entry, dict):
            adapters[entry["lora_name"]] = entry["lora_path"]
        else:
            name, _, path = str(entry).rpartition("=")
            adapters[name or path] = path
    return adapters


def _lora_options(args: dict[str, Any], num_paths: int) -> dict[str, Any]:
    """SGLang's LoRA ServerArgs as engine options. LoRA is on with enable_lora or lora_paths (SGLang
    turns it on for them); the adapter slots are max_loaded_loras, else max_loras_per_batch (8)."""
    if not (args.get("enable_lora") or num_paths):
        return {}
    options = {"max_loras": args.get("max_loaded_loras") or args.get("max_loras_per_batch") or 8}
    if args.get("max_lora_rank") is not None:
        options["max_lora_rank"] = args["max_lora_rank"]
    return options


def finish_reason(c: CompletionOutput) -> dict | None:
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.stop_reason}
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids)}
    if c.finish_reason == "abort":
        return {"type": "abort", "message": "aborted"}
    return None


def byte_layout(bucket: dict) -> dict:
    """SGLang's bucket in its current layout (a uint8 buffer, byte offsets). The older layout typed the
    buffer as its tensors' one dtype, with element offsets: reinterpret it as bytes."""
    buffer, metadata = bucket.get("flattened_tensor"), bucket.get("metadata")
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"bucket 'flattened_tensor' must be a tensor, got {type(buffer).__name__}")
    _check_metadata(metadata)
    if buffer.dtype == torch.uint8:
        return bucket
    size = buffer.element_size()
    entries = []
    for m in metadata:
        get = m.get if isinstance(m, dict) else lambda k, m=m: getattr(m, k)
        if parse_dtype(get("dtype")) != buffer.dtype:
            raise ValueError(f"bucket entry {get('name')!r} is {get('dtype')} inside a {buffer.dtype} buffer")
        entries.append(
            {
                "name": get("name"),
                "shape": tuple(get("shape")),
                "dtype": buffer.dtype,
                "start_idx": get("start_idx") * size,
                "end_idx": get("end_idx") * size,
            }
        )
    raw = buffer.contiguous().view(-1).view(torch.uint8)
    return {"flattened_tensor": raw, "metadata": entries}


BUCKET_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx")


def _check_metadata(metadata: Any) -> None:
    """A bucket's metadata: a list of entries, each a dict or an object with SGLang's fields."""
    if not isinstance(metadata, (list, tuple)):
        raise TypeError(f"bucket 'metadata' must be a list of entries, got {type(metadata).__name__}")
    for i, m in enumerate(metadata):
        has = (lambda k, m=m: k in m) if isinstance(m, dict) else (lambda k, m=m: hasattr(m, k))
        missing = [k for k in BUCKET_FIELDS if not has(k)]
        if missing:
            raise TypeError(
                f"bucket metadata[{i}] must be a dict or object with {list(BUCKET_FIELDS)}; "
                f"got {type(m).__name__} {m!r} lacking {missing}"
            )


def _is_payload_list(obj: Any) -> bool:
    return isinstance(obj, (list, tuple)) and bool(obj) and all(isinstance(p, (bytes, str)) for p in obj)


def _for_rank(payloads: list, rank: int) -> bytes | str:
    if rank >= len(payloads):
        raise ValueError(f"{len(payloads)} serialized payloads, none for TP rank {rank} (one per rank)")
    return payloads[rank]


class _Inboxes:
    """`_step_for`'s front of the step driver: steps until one of `rids` has outputs (or nothing is left
    to run); every stream's outputs go to its inbox."""

    def __init__(self, inbox: dict[str, list[RequestOutput]], rids: set[str]):
        self.inbox, self.rids = inbox, rids

    def poll(self, block: bool) -> bool | None:
        if block or any(self.inbox[r] for r in self.rids):
            return None  # outputs for the caller, or nothing left to run
        return False

    def deliver(self, items: list[tuple[Any, RequestOutput]]) -> None:
        for _, out in items:
            if out.request_id in self.inbox:
                self.inbox[out.request_id].append(out)

    def failed(self, error: Exception, ended: list[tuple[Hashable, Any]]) -> None:
        raise error
