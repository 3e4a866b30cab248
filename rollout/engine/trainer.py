"""What a trainer calls on the engine between rollouts: memory release and resume, weight updates
(tensors, broadcast groups, disk), weight reads and checksums, LoRA adapters, the prefix cache.

`Engine` inherits these methods; they run under its lock and use its components (memory, weights,
pages, lora, scheduler, pipeline). Requests in flight make an update or a release refuse, unless
abort=True aborts them (the next step reports them); retracted requests hold no KV and pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from rollout.engine.lock import serialised
from rollout.lora import LoraManager
from rollout.memory import check_tags
from rollout.weights import broadcast

log = logging.getLogger("rollout")


class TrainerMethods:
    """The memory, weight and adapter methods of `Engine` (see the module docstring)."""

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
        aborted = self.pipeline.abort_for_report()  # reported whole by the next step()
        log.warning("%s aborted %d in-flight requests", action, aborted)

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
