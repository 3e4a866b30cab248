"""The request bodies the server accepts: pydantic models that refuse unknown fields, so a typo gets a
400 naming the field instead of being ignored, and coerce nothing (strict): "4" is not an int, "no" is
not a bool, and true, 5.0 or "5" are not token ids, as the native engine refuses them too. An int is
still a float."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenIds = list[int]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CompletionRequest(Strict):
    model: str | None = None
    prompt: str | list[str] | TokenIds | list[TokenIds]
    n: int = 1
    best_of: int | None = None  # only best_of == n (no ranking of extra samples)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # top-k alternatives per token; the sampled token's logprob always
    echo: Literal[False] = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False
    user: str | None = None


class ChatRequest(Strict):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[Any] | None = None  # checked by rollout.chat.tools, which names the wrong field
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # a token-exact continuation: turn k's prompt ids (with token_ids on the last assistant message)
    prompt_token_ids: TokenIds | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False
    user: str | None = None


class SGLangSamplingParams(Strict):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    seed: int | None = Field(default=None, alias="sampling_seed")

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class GenerateRequest(Strict):
    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: SGLangSamplingParams = SGLangSamplingParams()
    return_logprob: bool = False
    top_logprobs_num: int = 0
    rid: str | list[str] | None = None
    stream: bool = False
    # MoE models on a server started with routed experts on: meta_info["routed_experts"]; streamed: with
    # the last chunk only, whole (SGLang reads them when a request finishes)
    return_routed_experts: bool = False


class AbortRequest(Strict):
    rid: str = ""
    abort_all: bool = False


class PauseRequest(Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class TagsRequest(Strict):
    tags: list[str] | None = None


class InitGroupRequest(Strict):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DistributedUpdateRequest(Strict):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class DestroyGroupRequest(Strict):
    group_name: str = "weight_update_group"


class DiskUpdateRequest(Strict):
    model_path: str
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class TensorUpdateRequest(Strict):
    # one entry per tensor-parallel rank, in `format` (rollout/serve/tensor_wire.py); None: safetensors,
    # or a pickle (SGLang's payload), which is refused unless the server was started to allow it
    serialized_named_tensors: list[str]
    format: Literal["safetensors", "cuda_ipc", "pickle"] | None = None
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
