"""An engine shaped like SGLang's offline `sglang.Engine`, so RL code written for it (verl, slime,
OpenRLHF) runs with only its import changed. See docs/compat.md.

Names and shapes are translated here, then the one `rollout.Engine` is called. As in SGLang, every
RL method (weights, groups, memory) answers `(success, message)` instead of raising: a bad payload,
path or group gives `(False, message)` and leaves the weights as they were (the core's loads are
all-or-nothing).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import torch

from rollout.compat import with_graphs
from rollout.compat.serialize import LocalSerializedTensor, MultiprocessingSerializer
from rollout.engine import Engine as CoreEngine
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.sampling import SamplingParams
from rollout.weights.bucket import FlattenedBucket, parse_dtype

log = logging.getLogger("rollout.compat")

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
    "log_level": ("log_level", lambda v: v),
}

# SGLang sampling-param key -> SamplingParams field
SAMPLING_KEYS = {
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "n": "n",
    "skip_special_tokens": "skip_special_tokens",
    "sampling_seed": "seed",
}
# accepted at their neutral value only: the core has no such option yet
NEUTRAL_KEYS = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_new_tokens": 0,
}
DEFAULT_GROUP = "weight_update_group"


class Engine:
    """`Engine(model_path, **server_args)` with SGLang's ServerArgs names (see SERVER_ARGS)."""

    def __init__(self, model_path: str | None = None, **kwargs: Any):
        model_path = kwargs.pop("model", model_path)
        if model_path is None:
            raise TypeError("Engine() needs model_path")
        self._weights_backup = bool(kwargs.pop("enable_weights_cpu_backup", False))
        unknown = sorted(set(kwargs) - set(SERVER_ARGS))
        if unknown:
            raise TypeError(f"Engine() got unknown server args {unknown}; known: {sorted(SERVER_ARGS)}")
        options = {SERVER_ARGS[k][0]: SERVER_ARGS[k][1](v) for k, v in kwargs.items()}
        self.engine = CoreEngine(model_path, **options)
        self.tokenizer = self.engine.tokenizer
        self._version_label: str | None = None  # set by an update that names its weight_version

    # -- generation -------------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        stream: bool = False,
    ) -> dict | list[dict]:
        """SGLang's output dicts: one for a single prompt with n=1, else a list (prompt-major)."""
        if stream:
            raise NotImplementedError("stream=True: use rollout.Engine.add_request(..., stream=True)")
        single = isinstance(prompt, str) or (
            input_ids is not None and len(input_ids) > 0 and not isinstance(input_ids[0], (list, tuple))
        )
        count = 1 if single else len(prompt if prompt is not None else input_ids or [])
        dicts = sampling_params if isinstance(sampling_params, list) else [sampling_params] * count
        params = [to_sampling_params(d, return_logprob, top_logprobs_num) for d in dicts]
        outs = self.engine.generate(prompt, params, input_ids=input_ids, use_tqdm=False)
        result = [
            self._output(o, c, (d or {}).get("no_stop_trim", False))
            for o, d in zip(outs, dicts)
            for c in o.outputs
        ]
        return result[0] if single and len(result) == 1 else result

    async def async_generate(self, *args: Any, **kwargs: Any) -> dict | list[dict]:
        # the core's lock serialises calls; a thread keeps the event loop free meanwhile
        return await asyncio.to_thread(self.generate, *args, **kwargs)

    def _output(self, out: RequestOutput, c: CompletionOutput, no_stop_trim: bool) -> dict:
        text = c.text
        if no_stop_trim and isinstance(c.stop_reason, str):
            text += c.stop_reason  # the core cuts the text just before the stop string
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
        return {"text": text, "output_ids": list(c.token_ids), "meta_info": meta}

    # -- weights ----------------------------------------------------------------------------------
    def update_weights_from_tensor(
        self,
        named_tensors: Any,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> tuple[bool, str]:
        """(name, tensor | LocalSerializedTensor) pairs, or with load_format="flattened_bucket" one
        MultiprocessingSerializer payload per TP rank (bytes or base64) or a bucket dict. The prefix
        cache is always flushed after a load (its KV came from the old weights), whatever flush_cache."""

        def run() -> str:
            if load_format == "flattened_bucket":
                bucket = self._bucket(named_tensors)
                if bucket is None:
                    return "empty bucket: nothing to load"
                count = self.engine.update_weights_from_tensor(bucket, load_format="flattened_bucket")
            else:
                count = self.engine.update_weights_from_tensor(self._named(named_tensors), load_format)
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
            return f"joined weights update group {group_name!r}"

        return self._rl("init_weights_update_group", run)

    def update_weights_from_distributed(
        self,
        names: list[str] | str,
        dtypes: list[Any] | Any,
        shapes: list[Any] | Any,
        group_name: str = DEFAULT_GROUP,
        flush_cache: bool = True,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> tuple[bool, str]:
        """One broadcast per name (or one flattened buffer); dtypes as torch dtypes or their names. A
        single name with its dtype and shape is taken as a list of one."""
        if isinstance(names, str):
            names, dtypes, shapes = [names], [dtypes], [shapes]

        def run() -> str:
            count = self.engine.update_weights_from_distributed(
                names, [parse_dtype(d) for d in dtypes], shapes, group_name, load_format
            )
            return f"loaded {count} tensors"

        return self._rl("update_weights_from_distributed", run, weight_version)

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> tuple[bool, str]:
        def run() -> str:
            self.engine.destroy_weights_update_group(group_name)
            return f"left weights update group {group_name!r}"

        return self._rl("destroy_weights_update_group", run)

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, weight_version: str | None = None
    ) -> tuple[bool, str]:
        def run() -> str:
            if load_format not in (None, "auto", "safetensors"):
                raise ValueError(f"load_format {load_format!r}: only safetensors checkpoints load")
            return f"loaded {self.engine.update_weights_from_disk(model_path)} tensors from {model_path}"

        return self._rl("update_weights_from_disk", run, weight_version)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The weight as float32 nested lists, first `truncate_size` rows (raises on an unknown name)."""
        return self.engine.get_weights_by_name(name, truncate_size).float().tolist()

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
        def run() -> str:
            self.engine.release_memory_occupation(tags, keep_weights_backup=self._weights_backup)
            return f"released {sorted(self.engine.released_tags)}"

        return self._rl("release_memory_occupation", run)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
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
def to_sampling_params(d: dict | None, return_logprob: bool, top_logprobs_num: int | None) -> SamplingParams:
    """SGLang's sampling-param dict as a SamplingParams (unknown keys raise, naming them)."""
    d = dict(d or {})
    d.pop("no_stop_trim", None)  # applied to the output by the front
    for key, neutral in NEUTRAL_KEYS.items():
        if key in d and d.pop(key) != neutral:
            raise ValueError(f"sampling param {key!r} is not supported yet (only {neutral!r})")
    unknown = sorted(set(d) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"unknown sampling params {unknown}; known: {sorted(SAMPLING_KEYS)}")
    fields = {SAMPLING_KEYS[k]: v for k, v in d.items() if v is not None}
    if "top_k" in fields and fields["top_k"] <= 0:
        fields["top_k"] = -1  # SGLang's "off"
    return SamplingParams(**fields, logprobs=return_logprob, top_logprobs=top_logprobs_num or 0)


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


def _is_payload_list(obj: Any) -> bool:
    return isinstance(obj, (list, tuple)) and bool(obj) and all(isinstance(p, (bytes, str)) for p in obj)


def _for_rank(payloads: list, rank: int) -> bytes | str:
    if rank >= len(payloads):
        raise ValueError(f"{len(payloads)} serialized payloads, none for TP rank {rank} (one per rank)")
    return payloads[rank]
