"""The gated delta rule (Gated DeltaNet linear attention), as transformers' Qwen3.5/Qwen3-Next compute it.

Per value head, with q and k L2-normalised and q scaled by Dk**-0.5, a state S [Dk, Dv] runs over the
tokens:  S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t.
Key heads are shared by Hv / Hk consecutive value heads.

Two entry points, both over a batch of requests whose states live in a pool of slots
(rollout/cache/state.py): `prefill` for chunks of any lengths (each request continues from its slot's
state, or from zero when `fresh`), `decode` for one token per request (in place, no host syncs, so CUDA
graphs can capture it). The torch code is the reference and the CPU path; on CUDA, prefill uses
flash-linear-attention's chunk kernel when it is installed (optional, MIT) and decode a Triton kernel
of ours (gated_delta_kernels.py).

The chunked form used for prefill: inside a chunk of C tokens from state S0, with G_t the cumulative
log decay, the corrections U solve (I + A) U = beta (V - exp(G) K S0), A[t, s] = beta_t exp(G_t - G_s)
k_t.k_s for s < t; then O = exp(G) Q S0 + (QK^T * exp(G_t - G_s))_{s<=t} U and
S_C = exp(G_C) S0 + sum_s exp(G_C - G_s) k_s u_s^T. Chunk boundaries are the kernel's business: the
state carried between prefill steps is exact, so a step may end anywhere.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

CHUNK = 64
EPS = 1e-6  # of the L2 norm, as transformers and fla


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + EPS)


def prepare(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 q, k [T, Hv, Dk]: L2-normalised, q scaled, key heads repeated for their value heads."""
    rep = num_v_heads // q.shape[1]
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    return q, k


def chunked_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request. q, k: [L, H, Dk] prepared; v: [L, H, Dv]; g, beta: [L, H]; state: [H, Dk, Dv] float32.
    Returns (o [L, H, Dv] float32, the state after the L tokens)."""
    L = q.shape[0]
    pad = -L % chunk
    # padding tokens have beta = 0 (no write) and g = 0 (no decay): the final state is unchanged by them
    q, k, v = (F.pad(x.float(), (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))  # [H, L', D]
    g, beta = (F.pad(x.float(), (0, 0, 0, pad)).transpose(0, 1) for x in (g, beta))  # [H, L']
    H, n = q.shape[0], q.shape[1] // chunk
    q, k, v = (x.reshape(H, n, chunk, -1) for x in (q, k, v))
    G = g.reshape(H, n, chunk).cumsum(-1)
    beta = beta.reshape(H, n, chunk, 1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # exp(G_t - G_s) for s <= t (masked before exp: G_t - G_s > 0 above the diagonal could overflow)
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    system = eye + (beta * (k @ k.transpose(-1, -2)) * decay).tril(-1)  # I + A
    inner = (q @ k.transpose(-1, -2)) * decay  # [H, n, C, C]
    # the two right-hand sides that do not depend on S0 (solved for all chunks at once)
    bv = torch.linalg.solve_triangular(system, beta * v, upper=False, unitriangular=True)
    bk = torch.linalg.solve_triangular(
        system, beta * k * G.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    q_decayed = q * G.exp().unsqueeze(-1)
    k_to_end = k * (G[..., -1:] - G).exp().unsqueeze(-1)
    out = torch.empty_like(v)
    S = state.float()
    for c in range(n):
        u = bv[:, c] - bk[:, c] @ S  # [H, C, Dv]
        out[:, c] = q_decayed[:, c] @ S + inner[:, c] @ u
        S = S * G[:, c, -1].exp().view(H, 1, 1) + k_to_end[:, c].transpose(-1, -2) @ u
    out = out.reshape(H, n * chunk, -1)[:, :L].transpose(0, 1)
    return out, S


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    q_lens: list[int],
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunks of several requests, concatenated. q, k: [T, Hk, Dk] (raw: normalised here); v: [T, Hv, Dv];
    g (log decay), beta: [T, Hv]. Request b reads its state from pool[slots[b]] (zero where fresh[b]) and
    writes the state after its chunk back there. Returns o [T, Hv, Dv] in v's dtype."""
    init = torch.where(fresh.view(-1, 1, 1, 1), 0.0, pool[slots].float())
    if q.is_cuda and fla_available() and cu_seqlens is not None:
        out, final = _fla_prefill(q, k, v, g, beta, init, cu_seqlens)
    else:
        qp, kp = prepare(q, k, v.shape[1])
        outs, finals = [], []
        for b, (qs, ks, vs, gs, bs) in enumerate(
            zip(*(x.split(q_lens) for x in (qp, kp, v, g, beta)), strict=True)
        ):
            o, s = chunked_one(qs, ks, vs, gs, bs, init[b])
            outs.append(o), finals.append(s)
        out, final = torch.cat(outs), torch.stack(finals)
    pool.index_copy_(0, slots, final.to(pool.dtype))
    return out.to(v.dtype)


def decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One token per request, B requests: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv]; the states
    pool[slots] are updated in place. Returns o [B, Hv, Dv] in v's dtype."""
    if q.is_cuda:
        from rollout.layers.gated_delta_kernels import decode_step

        return decode_step(q, k, v, g, beta, pool, slots)
    return decode_torch(q, k, v, g, beta, pool, slots)


def decode_torch(q, k, v, g, beta, pool, slots) -> torch.Tensor:
    """`decode` in torch ops (the reference; also capturable: it has no host syncs)."""
    qp, kp = prepare(q, k, v.shape[1])  # [B, H, Dk]
    S = pool[slots].float() * g.float().exp()[..., None, None]
    u = (v.float() - (S * kp.unsqueeze(-1)).sum(-2)) * beta.float().unsqueeze(-1)  # [B, H, Dv]
    S = S + kp.unsqueeze(-1) * u.unsqueeze(-2)
    out = (S * qp.unsqueeze(-1)).sum(-2)
    pool.index_copy_(0, slots, S.to(pool.dtype))
    return out.to(v.dtype)


def recurrent_reference(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token, one request (the definition; tests hold the chunked form to it).
    q, k: [L, Hk, Dk] raw; v: [L, Hv, Dv]; state: [Hv, Dk, Dv]. Returns (o [L, Hv, Dv], final state)."""
    qp, kp = prepare(q, k, v.shape[1])
    S, outs = state.float().clone(), []
    for t in range(q.shape[0]):
        S = S * g[t].float().exp()[:, None, None]
        u = (v[t].float() - (S * kp[t].unsqueeze(-1)).sum(-2)) * beta[t].float().unsqueeze(-1)
        S = S + kp[t].unsqueeze(-1) * u.unsqueeze(-2)
        outs.append((S * qp[t].unsqueeze(-1)).sum(-2))
    return torch.stack(outs), S


# -- flash-linear-attention (optional) ---------------------------------------------------------------
@functools.cache
def fla_available() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def _fla_prefill(q, k, v, g, beta, init, cu_seqlens):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    rep = v.shape[1] // q.shape[1]
    if rep > 1:  # fla takes as many key heads as value heads
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    out, final = chunk_gated_delta_rule(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        g=g.float().unsqueeze(0),
        beta=beta.unsqueeze(0).to(q.dtype),
        scale=q.shape[-1] ** -0.5,
        initial_state=init,
        output_final_state=True,
        cu_seqlens=cu_seqlens.long(),
        use_qk_l2norm_in_kernel=True,
    )
    return out.squeeze(0), final
