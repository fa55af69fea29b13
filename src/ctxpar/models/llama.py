"""A small Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention.

Single-device code: nothing here knows about ranks. RoPE takes explicit position ids,
so a caller that feeds a shard of the sequence passes the shard's global positions;
attention goes through ``Attention.attention_fn`` (default: causal SDPA), which
``ctxpar.parallelize.apply_context_parallel`` swaps for context-parallel attention. A
packed row passes ``documents=`` (its document lengths) to ``forward``: every layer's
attention then stays within documents, on one device or under CP alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ctxpar.masks import make_mask
from ctxpar.models.config import ModelConfig

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents=None) -> torch.Tensor:
    """Single-device causal attention; q (B, H, T, D), k/v (B, H_kv, T, D); with
    ``documents`` (lengths or cu_seqlens of the packed row) only within each document."""
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    t = q.shape[2]
    positions = torch.arange(t)
    visible = make_mask(t, causal=True, documents=documents).visible(positions, positions, t).to(q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(compute_dtype(x.dtype))
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What RMSNorm and RoPE compute in for a model of ``dtype``: float32, or float64 for a
    float64 model (float32 throughout made ``.double()`` only float32-accurate, 1e-7)."""
    return torch.promote_types(dtype, torch.float32)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (B, 1, T, D/2) in ``dtype`` (``compute_dtype`` of the model's) for
    integer positions (B, T) or (T,)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=dtype) / head_dim)
    angles = positions.to(dtype).unsqueeze(-1) * inv_freq  # (..., T, D/2)
    if angles.dim() == 2:
        angles = angles.unsqueeze(0)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :D/2], x[..., D/2:]) by the position angles; x (B, H, T, D)."""
    x1, x2 = x.to(compute_dtype(x.dtype)).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wq = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        self.attention_fn: AttentionFn = causal_sdpa

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents=None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.cfg.heads, self.cfg.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(x).view(b, t, self.cfg.kv_heads, self.cfg.head_dim).transpose(1, 2)  # (B, H_kv, T, D)
        v = self.wv(x).view(b, t, self.cfg.kv_heads, self.cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.attention_fn(q, k, v) if documents is None else self.attention_fn(q, k, v, documents=documents)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.cfg.heads * self.cfg.head_dim))  # t may be 0


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents=None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, documents)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder-only LM: token ids (B, T) -> logits (B, T, vocab)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.head_dim % 2:
            raise ValueError(f"head_dim={cfg.head_dim}: the reference model's RoPE rotates pairs of dims, so "
                             f"head_dim must be even")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.activation_checkpointing = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, documents=None, *,
                head: bool = True) -> torch.Tensor:
        """tokens (B, T) int64; positions (B, T) or (T,) global positions, default 0..T-1 (for
        a packed row, positions within each document); documents: the packed row's document
        lengths (or cu_seqlens), None for one document. -> logits (B, T, vocab); with
        ``head=False`` the final-norm states (B, T, d) instead (``hidden_states``)."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta,
                                compute_dtype(self.embed.weight.dtype))
        x = self.embed(tokens)  # (B, T, d)
        for layer in self.layers:
            if self.activation_checkpointing and self.training:
                x = checkpoint(layer, x, cos, sin, documents, use_reentrant=False)
            else:
                x = layer(x, cos, sin, documents)
        x = self.norm(x)  # (B, T, d)
        return self.output(x) if head else x  # (B, T, vocab) or (B, T, d)

    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                      documents=None) -> torch.Tensor:
        """``forward`` without the LM head: the final-norm states (B, T, d). Prefill needs
        the logits of one position only, and (T/P, vocab) of them would dwarf the KV cache.
        A module call, so that the hooks of the forward (context parallelism's positions
        guard, FSDP's parameter gathering) run for it too."""
        return self(tokens, positions, documents, head=False)
