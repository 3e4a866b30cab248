"""Turns a scheduled batch into tensors, runs the model and samples: the device side of a step.

Host work per step is numpy over the batch (no per-request tensor work): the page table comes from a
mirror updated incrementally (page_table.py), and the batch's integers reach the device in one pinned,
non-blocking copy (device/staging.py). Decode steps that fit a captured CUDA graph write straight into its
static buffers.

A decode batch of the same sequences as the last step (the steady state) reuses what cannot have
changed (_DecodeState): their page-table rows (only rows entering a new page are synced), sampling
parameters, seeds and LoRA slots. `launch` queues a step and returns it in flight (`Launched`): its
tokens stay on the device, where the next step may take its input ids from, and come back to the host
in one non-blocking copy that `collect` waits for.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rollout.attention.base import AttentionBackend, AttnBatch, ForwardContext
from rollout.cache.state import StateBatch, StatePool
from rollout.device.staging import Staging, to_device
from rollout.runner.batch import HostBatch, StepInputs, StepOutput
from rollout.runner.graphs import CaptureContext, GraphRunner
from rollout.runner.logit_adjust import LogitAdjust
from rollout.runner.page_table import HostPageTable
from rollout.runner.prompt_logprobs import prompt_logprobs
from rollout.runner.sampler import SampleResult, SamplingBatch, sample
from rollout.runner.state_slots import SlotTable, Snapshots, snapshot_point
from rollout.state.sequence import Sequence, draws, hashed_uniforms, seeds, uniforms

if TYPE_CHECKING:
    from rollout.cache.routes import RouteStore
    from rollout.lora import LoraManager
    from rollout.state.scheduled import ScheduledBatch


@dataclass
class _DecodeState:
    """The last decode step's batch, kept while the next one holds the same sequences."""

    seq_ids: list[int]
    rows: np.ndarray  # int64 [B]: their page-table rows
    positions: np.ndarray  # int64 [B]: the positions the step computed
    seeds: np.ndarray  # uint64 [B]
    draws: np.ndarray  # uint64 [B]: the output index the step sampled
    sampling: SamplingBatch
    token_slots: np.ndarray | None
    graph_bs: int | None  # the CUDA graph that ran it (None: eager)
    state_slots: np.ndarray | None = None


@dataclass
class Launched:
    """A step whose device work is queued. `tokens` (device, int64 [N]) are the sampled tokens of batch
    rows `sampled`, whose sequences are `seq_ids`; `packed` is their host copy (tokens, logprobs, top
    logprobs), complete once `event` has passed."""

    sampled: list[int]
    seq_ids: list[int]
    tokens: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    event: Any = None
    num_top: int = 0
    prompt: dict | None = None  # logprobs of given tokens (host values already)
    ranks: bool = False  # the packed rows end with the sampled tokens' ranks

    @classmethod
    def start(cls, sampled: list[int], seq_ids: list[int], res: SampleResult, k: int, prompt) -> Launched:
        """Queue one device-to-host copy of everything the step produced (pinned, non-blocking)."""
        cols = [res.tokens.double().unsqueeze(1), res.logprobs.double().unsqueeze(1)]
        if k:
            cols += [res.top_ids.double(), res.top_logprobs.double()]
        if res.ranks is not None:
            cols.append(res.ranks.double().unsqueeze(1))
        packed, event = torch.cat(cols, dim=1), None
        if packed.is_cuda:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            packed = host
        return cls(sampled, seq_ids, res.tokens, packed, event, k, prompt, res.ranks is not None)

    def collect(self) -> StepOutput | None:
        """Wait for the copy; the host-side results (None: nothing sampled and no prompt logprobs)."""
        if self.packed is None:
            return None if self.prompt is None else StepOutput([], [], None, self.prompt)
        if self.event is not None:
            self.event.synchronize()
        out = _unpack(self.packed.tolist(), self.num_top, self.ranks)
        out.prompt = self.prompt
        return out


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        vocab_size: int,
        device: torch.device,
        *,
        max_model_len: int = 4096,
        max_running: int = 256,
        lora: LoraManager | None = None,
        eos_ids: frozenset[int] = frozenset(),
        state: StatePool | None = None,
        state_slots: int = 0,
        snapshots: Snapshots | None = None,
        routes: RouteStore | None = None,
    ):
        # per-request state of the model (None: it keeps none); a sequence's slot comes from state_slots
        self.state, self.snapshots = state, snapshots
        self.state_slots = SlotTable(state_slots) if state is not None else None
        self.lora = lora  # adapter slots (None: LoRA off)
        self.routes = routes  # where MoE layers record their routed experts (None: not recorded)
        self.model, self.backend, self.vocab_size, self.device = model, backend, vocab_size, device
        self.eos_ids = eos_ids  # what min_tokens masks
        self.staging = Staging(device)  # the pinned buffers of every step's uploads
        self.page_size = backend.kv.page_size
        self.max_model_len = max_model_len
        self.page_table = HostPageTable(2 * max_running + 8, -(-max_model_len // self.page_size))
        self.graphs: GraphRunner | None = None  # decode graphs, once captured
        self.graph_steps = self.eager_steps = 0
        self._decode: _DecodeState | None = None

    def reset(self) -> None:
        """Forget the kept decode batch (the engine calls it around weight, memory and adapter changes,
        so nothing kept outlives them; a kept batch also checks itself every step)."""
        self._decode = None

    def reset_state(self) -> None:
        """Forget every state slot (the pool was released: nothing in flight holds one)."""
        if self.state_slots is not None:
            self.state_slots.reset()
        self._decode = None

    def capture_graphs(
        self, max_bs: int, hidden_size: int, dtype: torch.dtype, capture: CaptureContext
    ) -> None:
        """Capture decode graphs for batch sizes up to `max_bs`; from then on `step` replays one whenever
        a decode batch fits."""
        self.graphs = GraphRunner(
            self.model,
            self.backend,
            max_bs=max_bs,
            max_pages=-(-self.max_model_len // self.page_size),
            hidden_size=hidden_size,
            dtype=dtype,
            device=self.device,
            capture_context=capture,
            lora=self.lora.state if self.lora is not None else None,
            routes=self.routes,
            state=self.state,
        )
        self.graphs.capture()

    # -- host side --------------------------------------------------------------------------------
    def host_batch(self, batch: ScheduledBatch) -> HostBatch:
        return self._host_arrays(batch, self.page_table.rows(batch.seqs))

    def _host_arrays(self, batch: ScheduledBatch, rows: np.ndarray) -> HostBatch:
        seqs, S = batch.seqs, self.page_size
        B = len(seqs)
        starts = np.fromiter((s.num_computed for s in seqs), dtype=np.int64, count=B)
        if batch.decode:
            ids = np.fromiter((s.token_ids[-1] for s in seqs), dtype=np.int64, count=B)
            positions, seq_lens = starts, starts + 1
            sampled = np.arange(B)
        else:
            chunks = np.asarray(batch.chunks, dtype=np.int64)
            seq_lens = starts + chunks
            ids = np.concatenate([s.token_ids[a : a + c] for s, a, c in zip(seqs, starts, chunks)])
            positions = np.arange(len(ids)) - np.repeat(np.cumsum(chunks) - chunks - starts, chunks)
            totals = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=B)
            sampled = np.flatnonzero(seq_lens == totals)
        table = self.page_table.gather(rows, int(-(-seq_lens.max() // S)))
        owner = np.repeat(np.arange(B), batch.chunks) if not batch.decode else np.arange(B)
        slots = table[owner, positions // S].astype(np.int64) * S + positions % S
        lora = self._token_slots(seqs, owner)
        host = HostBatch(batch.decode, ids, positions, slots, seq_lens, batch.chunks, table, sampled, lora)
        if self.state_slots is not None:
            host.state_slots, host.fresh = self.state_slots.slots(seqs), starts == 0
            self._copy_in(seqs, host.state_slots)
        return host

    def _copy_in(self, seqs: list[Sequence], slots: np.ndarray) -> None:
        """Sequences that share a cached prefix start from its kept state (copied before the step)."""
        rows = [i for i, s in enumerate(seqs) if s.state_from is not None]
        if rows:
            src = np.array([seqs[i].state_from for i in rows], dtype=np.int64)
            self.state.copy(*to_device([src, slots[rows]], self.device, self.staging))
            for i in rows:
                seqs[i].state_from = None

    def _snapshot_out(self, batch: ScheduledBatch, slots: np.ndarray | None) -> None:
        """Keep the state of prompts with followers at their snapshot point (cache/state.py)."""
        if self.snapshots is None or batch.decode:
            return
        src, dst = [], []
        for i, (seq, chunk) in enumerate(zip(batch.seqs, batch.chunks)):
            point = snapshot_point(seq, self.page_size) if seq.followers else 0
            slot = self.snapshots.take(seq, point) if point and seq.num_computed + chunk == point else None
            if slot is not None:
                src.append(slots[i])
                dst.append(slot)
        if src:
            self.state.copy(*to_device([np.array(src), np.array(dst)], self.device, self.staging))

    def _token_slots(self, seqs: list, owner: np.ndarray) -> np.ndarray | None:
        """Each token's LoRA slot (from its sequence's lora_name); None when no token uses an adapter."""
        if self.lora is None or all(s.params.lora_name is None for s in seqs):
            return None
        slot = self.lora.slot
        per_seq = np.fromiter((slot(s.params.lora_name) for s in seqs), dtype=np.int64, count=len(seqs))
        return per_seq[owner]

    def prepare(self, batch: ScheduledBatch, prev: Launched | None = None) -> StepInputs:
        """The step's device inputs; with `prev` (the step in flight), pending input ids are taken from
        its sampled tokens on the device."""
        return self._prepare(batch, prev)[0]

    def _prepare(
        self, batch: ScheduledBatch, prev: Launched | None
    ) -> tuple[StepInputs, HostBatch, list[int]]:
        if batch.decode:
            host, sampling, seq_ids = self._decode_host(batch)
        else:
            self._decode = None
            host = self.host_batch(batch)
            seqs = [batch.seqs[i] for i in host.sampled.tolist()]
            sampling = self._sampling(seqs, uniforms(seqs))
            seq_ids = [s.seq_id for s in seqs]
        if self._graph_bs(host) is not None:
            inputs = self.graphs.load(host, sampling)
        else:
            inputs = self.eager_inputs(host, sampling)
        if prev is not None:
            _take_pending_ids(inputs.input_ids, host, batch.seqs, seq_ids, prev, self.staging)
        return inputs, host, seq_ids

    def _graph_bs(self, host: HostBatch) -> int | None:
        if host.decode and self.graphs is not None and self.graphs.fits(host.batch_size):
            return self.graphs.padded(host.batch_size)
        return None

    def _sampling(self, seqs: list[Sequence], us: np.ndarray) -> SamplingBatch | None:
        if not seqs:
            return None
        sampling = SamplingBatch.build(
            [s.params for s in seqs], us, self.vocab_size, self.device, staging=self.staging
        )
        if sampling.adjusts_logits:
            sampling.adjust = LogitAdjust.build(
                seqs, self.eos_ids, self.vocab_size, self.device, self.staging
            )
        return sampling

    def _decode_host(self, batch: ScheduledBatch) -> tuple[HostBatch, SamplingBatch, list[int]]:
        """A decode step's host batch and sampling; the kept state when the sequences are the last
        step's, one token further (anything else, a preempted and resumed sequence included, rebuilds)."""
        seqs, state = batch.seqs, self._decode
        seq_ids = [s.seq_id for s in seqs]
        starts = np.fromiter((s.num_computed for s in seqs), dtype=np.int64, count=len(seqs))
        if state is None or state.seq_ids != seq_ids or not np.array_equal(starts, state.positions + 1):
            rows = self.page_table.rows(seqs)
            host = self._host_arrays(batch, rows)
            sd, dr = seeds(seqs), draws(seqs)
            sampling = self._sampling(seqs, hashed_uniforms(sd, dr))
            graph_bs = self._graph_bs(host)
            self._decode = _DecodeState(
                seq_ids, rows, starts, sd, dr, sampling, host.token_slots, graph_bs, host.state_slots
            )
            return host, sampling, seq_ids
        S = self.page_size
        entered = np.flatnonzero(starts % S == 0)  # these sequences' new token starts a new page
        if len(entered):
            self.page_table.rows([seqs[i] for i in entered.tolist()])
        seq_lens = starts + 1
        table = self.page_table.gather(state.rows, int(-(-seq_lens.max() // S)))
        slots = table[np.arange(len(seqs)), starts // S].astype(np.int64) * S + starts % S
        ids = np.fromiter((s.token_ids[-1] for s in seqs), dtype=np.int64, count=len(seqs))
        host = HostBatch(
            True, ids, starts, slots, seq_lens, [1] * len(seqs), table, np.arange(len(seqs)),
            state.token_slots, state.state_slots,
        )  # fmt: skip
        if state.state_slots is not None:
            host.fresh = np.zeros(len(seqs), dtype=bool)
        graph_bs = self._graph_bs(host)
        host.same_seqs = graph_bs == state.graph_bs  # and the same path: a graph's buffers hold them
        host.same_pages = host.same_seqs and not len(entered)
        state.positions, state.graph_bs = starts, graph_bs
        state.draws = state.draws + np.uint64(1)
        us = to_device([hashed_uniforms(state.seeds, state.draws)], self.device, self.staging)[0]
        sampling = replace(state.sampling, uniforms=us)
        if sampling.adjusts_logits:  # min_tokens and penalties follow the tokens: rebuilt every step
            sampling.adjust = LogitAdjust.build(
                seqs, self.eos_ids, self.vocab_size, self.device, self.staging
            )
        return host, sampling, seq_ids

    def eager_inputs(self, host: HostBatch, sampling: SamplingBatch | None) -> StepInputs:
        B = host.batch_size
        cu = np.zeros(B + 1, dtype=np.int32)
        np.cumsum(host.q_lens, out=cu[1:])
        arrays = [
            host.ids,
            host.positions,
            host.slots,
            cu[1:][host.sampled].astype(np.int64) - 1,
            host.page_table,
            host.seq_lens.astype(np.int32),
            cu,
        ]
        if host.state_slots is not None:
            arrays += [host.state_slots, host.fresh.astype(bool)]
        if host.token_slots is not None:
            arrays.append(host.token_slots)
        ids, positions, slots, rows, page_table, seq_lens, cu_seqlens, *rest = to_device(
            arrays, self.device, self.staging
        )
        state = None
        if host.state_slots is not None:
            state_slots, fresh, *rest = rest
            state = StateBatch(self.state, state_slots, fresh, host.q_lens, cu_seqlens, host.decode)
        attn = AttnBatch(
            decode=host.decode,
            q_lens=host.q_lens,
            seq_lens_cpu=host.seq_lens.tolist(),
            page_table=page_table,
            seq_lens=seq_lens,
            cu_seqlens_q=cu_seqlens,
            slot_mapping=slots,
            max_q_len=max(host.q_lens),
            max_seq_len=int(host.seq_lens.max()),
            page_table_cpu=host.page_table,
        )
        # decode samples every row: a slice avoids a gather
        logit_rows = slice(0, B) if host.decode else rows
        lora = rest[0] if rest else None
        return StepInputs(ids, positions, attn, logit_rows, sampling, lora_slots=lora, state=state)

    # -- device side ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_hidden(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states [T, hidden] of every token of the step."""
        if inputs.graph_bs is not None:
            self.graph_steps += 1
            return self.graphs.replay(inputs)
        self.eager_steps += 1
        if self.lora is not None:
            self.lora.state.begin(inputs.lora_slots)
        routes = self.routes.sink(inputs.attn.slot_mapping) if self.routes is not None else None
        ctx = ForwardContext(self.backend, self.backend.begin(inputs.attn), inputs.state, routes=routes)
        return self.model(inputs.input_ids, inputs.positions, ctx)

    @torch.inference_mode()
    def forward_logits(self, inputs: StepInputs) -> torch.Tensor:
        """float32 logits [N, vocab] for the rows that sample."""
        return self.model.logits(self.forward_hidden(inputs)[inputs.logit_rows])

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, prev: Launched | None = None) -> Launched:
        """Queue the step on the device and return it in flight (see `Launched`). `prev`: the step still
        in flight, whose sampled tokens are this decode step's pending input ids."""
        inputs, host, seq_ids = self._prepare(batch, prev)
        hidden = self.forward_hidden(inputs)
        self._snapshot_out(batch, host.state_slots)
        # logprobs of given tokens at the chunk's positions (runner/prompt_logprobs.py), before sampling
        prompt = prompt_logprobs(self.model, hidden, batch, self.vocab_size)
        sampled = host.sampled.tolist()
        if inputs.sampling is None:
            return Launched(sampled, seq_ids, prompt=prompt)
        logits = self.model.logits(hidden[inputs.logit_rows])
        res = sample(logits, inputs.sampling)
        return Launched.start(sampled, seq_ids, res, inputs.sampling.num_top_logprobs, prompt)

    def step(self, batch: ScheduledBatch) -> StepOutput | None:
        """Run one step to the end: `launch`, then `collect`."""
        return self.launch(batch).collect()


def _take_pending_ids(
    input_ids: torch.Tensor,
    host: HostBatch,
    seqs: list[Sequence],
    seq_ids: list[int],
    prev: Launched,
    staging: Staging,
) -> None:
    """Overwrite, on the device, the input ids of the sequences whose last token `prev` samples (a
    decode step's rows, or a mixed prefill step's decoding rows: one token each, its chunk's last)."""
    if prev.tokens is None:
        return
    if host.decode and prev.seq_ids == seq_ids:  # the steady state: the same sequences, in the same order
        input_ids[: len(seq_ids)].copy_(prev.tokens)
        return
    where = {sid: i for i, sid in enumerate(prev.seq_ids)}
    ends = np.cumsum(host.q_lens) - 1  # each row's last token
    pairs = [(int(ends[b]), where[s.seq_id]) for b, s in enumerate(seqs) if s.pending]
    if pairs:
        dst, src = to_device([np.array(p, dtype=np.int64) for p in zip(*pairs)], input_ids.device, staging)
        input_ids.index_copy_(0, dst, prev.tokens.index_select(0, src))


def _unpack(rows: list[list[float]], k: int, ranks: bool = False) -> StepOutput:
    tokens = [int(r[0]) for r in rows]
    logprobs = [r[1] for r in rows]
    top = [dict(zip(map(int, r[2 : 2 + k]), r[2 + k : 2 + 2 * k])) for r in rows] if k else None
    return StepOutput(tokens, logprobs, top, ranks=[int(r[2 + 2 * k]) for r in rows] if ranks else None)
