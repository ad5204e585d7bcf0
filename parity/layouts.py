"""Weight layouts shared by both engines.

Both sides hold the *same* fused tensors in the *same* layout, so that a GEMM output column
comes from the same weight row on both sides (a GEMM's edge columns can take a different
micro-kernel, so a permuted layout could change bits). The layout is Megatron's:

- QKV: rows grouped per KV head: [q heads of group 0; k_0; v_0; q heads of group 1; k_1; ...].
- gate/up: [gate; up] stacked on the output dim.
"""

from __future__ import annotations

import torch


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """HF q/k/v projection weights [Hq*D, H], [Hkv*D, H], [Hkv*D, H] -> fused grouped QKV."""
    hidden = q.shape[1]
    qg = q.view(num_kv_heads, -1, hidden)
    kg = k.view(num_kv_heads, -1, hidden)
    vg = v.view(num_kv_heads, -1, hidden)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, hidden).contiguous()


def unpack_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of pack_qkv."""
    hidden = qkv.shape[1]
    per_group = num_heads // num_kv_heads * head_dim
    grouped = qkv.view(num_kv_heads, per_group + 2 * head_dim, hidden)
    q, k, v = grouped.split([per_group, head_dim, head_dim], dim=1)
    return (
        q.reshape(-1, hidden).contiguous(),
        k.reshape(-1, hidden).contiguous(),
        v.reshape(-1, hidden).contiguous(),
    )


def split_qkv(
    mixed: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused QKV activations [..., Hkv*(G+2)*D] -> q [..., Hq, D], k, v [..., Hkv, D]."""
    g = num_heads // num_kv_heads
    lead = mixed.shape[:-1]
    grouped = mixed.view(*lead, num_kv_heads, (g + 2) * head_dim)
    q, k, v = grouped.split([g * head_dim, head_dim, head_dim], dim=-1)
    return (
        q.reshape(*lead, num_heads, head_dim),
        k.reshape(*lead, num_kv_heads, head_dim),
        v.reshape(*lead, num_kv_heads, head_dim),
    )


def pack_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0).contiguous()


def unpack_gate_up(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = fused.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def pack_qkv_activations(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int
) -> torch.Tensor:
    """q [..., Hq*D], k/v [..., Hkv*D] -> [..., Hkv*(G+2)*D] in the grouped QKV layout."""
    lead = q.shape[:-1]
    parts = [t.reshape(*lead, num_kv_heads, -1) for t in (q, k, v)]
    return torch.cat(parts, dim=-1).reshape(*lead, -1)
