"""torch's fused CPU attention op for one block: (out, lse) forward, and backward from lse.

``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``) takes K/V with
fewer heads than Q (GQA) directly. Its backward recomputes probabilities as
exp(q k^T * scale - lse) and uses rowsum(dout * out) as delta, so handing it the merged,
global (out, lse) yields this block's exact share of the gradient.

bfloat16 / float16 blocks are computed in float32 (inputs upcast per block, a copy of
O(S*D) against O(S^2*D) work). Rounding each block's output and dK/dV to bf16 before
they are merged and summed over P blocks would add P roundings to the one that
single-process attention makes; K/V still travel between ranks in bf16.

A PARTIAL tile's bool mask goes to the op as an additive float mask (0 / -inf, the op's
dtype); the op gives a row that sees no key lse 0 where attention has -inf, so those
rows' lse are set to -inf after the call, as are those of rows whose visible keys all
score -inf (``_massless``). A PARTIAL tile whose q or k holds an inf or NaN goes to the
reference kernel instead, which hides masked scores rather than adding -inf to them.

Every tensor handed to the op goes through ``unit_stride``: the op reads the last dim as
dense whatever its stride (a no-op for tensors strategies already made dense once per
shard).
"""

from __future__ import annotations

import torch

from ctxpar.kernels import reference
from ctxpar.kernels.contract import accumulation_dtype, check_heads, unit_stride

_cpu_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_cpu_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _prepare(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the op needs: the accumulation dtype and a dense last dim. A tensor already in it
    is not passed to ``.to``, which returns it as it is after a call that cost more than the
    check (9 per tile, a tenth of a small tile's host time)."""
    c = accumulation_dtype(tensors[0].dtype)
    return tuple(unit_stride(t if t.dtype == c else t.to(c)) for t in tensors)


def _additive(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """Bool (Sq, Sk) -> 0 where visible, -inf elsewhere, in ``like``'s dtype and device."""
    if mask is None:
        return None
    zeros = torch.zeros(mask.shape, dtype=like.dtype, device=like.device)
    return zeros.masked_fill_(~mask.to(like.device), float("-inf"))


def _scores_hidden_exactly(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether a tile must go to the reference kernel: one with an explicit mask (PARTIAL)
    whose q or k holds an inf or NaN. The op adds the mask to the scores (-inf where hidden),
    and a hidden +inf or NaN score then poisons a row that cannot see it (inf - inf: rows of
    other documents); the reference hides masked scores instead (O(Sq*D + Sk*D) to check)."""
    # by the sums (30x cheaper on CPU than testing each element), taken in float32 or wider (a
    # float16 sum passes 65504 at once): one that overflows sends a finite tile to the reference
    # kernel too, exact if slower
    acc = accumulation_dtype(q.dtype)
    return mask is not None and not (bool(q.sum(dtype=acc).isfinite()) and bool(k.sum(dtype=acc).isfinite()))


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    check_heads(q, k, v)
    if _scores_hidden_exactly(q, k, mask):
        return reference.attention_forward(q, k, v, causal=causal, scale=scale, mask=mask)
    q, k, v = _prepare(q, k, v)
    out, lse = _cpu_fwd(q, k, v, 0.0, causal, attn_mask=_additive(mask, q), scale=scale)
    if mask is not None:
        lse.masked_fill_(~mask.to(lse.device).any(-1), float("-inf"))  # rows that see no key here
    if not lse.all():  # an lse of exactly 0: the op's for a row without mass, and almost never another's
        lse.masked_fill_(_massless(q, k, out, lse == 0, causal=causal, scale=scale, mask=mask), float("-inf"))
    # the op gives a NaN query row a finite (out, lse) where attention by definition gives
    # NaN: restore that, so CP poisons the same rows as single-process SDPA (O(Sq*D) per block;
    # looked for row by row only where the tile's sum is NaN, as a NaN makes it: 20x cheaper,
    # and one sum to a number costs half of one per row, or less)
    lse = lse.to(out.dtype)
    if bool(q.sum().isnan()):
        nan_rows = q.isnan().any(-1)  # (B, H, Sq)
        out.masked_fill_(nan_rows.unsqueeze(-1), float("nan"))
        lse.masked_fill_(nan_rows, float("nan"))
    return out, lse


_RESCORED_SCORES = 1 << 22  # scores of suspect rows held at once (16 MiB in float32)


def _massless(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, suspects: torch.Tensor, *, causal: bool,
              scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """(B, H, Sq) bool: of the ``suspects`` (rows given lse 0), those whose visible keys all
    score -inf (an -inf in q or k, or a product past the float range), which have no softmax
    mass here. The op gives them out 0 and lse 0, which would merge as a key of weight 1 and
    value 0. Only rows given exactly that are rescored: the rare row that truly has lse 0
    and out 0 (one key, scored 0, of value 0) stays as it is."""
    suspects = suspects & (out == 0).all(-1)
    group, keys = q.shape[1] // k.shape[1], torch.arange(k.shape[2], device=q.device)
    rows_at_once = max(1, _RESCORED_SCORES // k.shape[2])  # bounded memory if a whole tile is suspect
    for b, kv_head in {(b, h // group) for b, h in suspects.nonzero()[:, :2].tolist()}:
        heads = slice(kv_head * group, (kv_head + 1) * group)
        rows = suspects[b, heads]  # (G, Sq), a view: written through below
        for h, i in zip(*(part.split(rows_at_once) for part in rows.nonzero(as_tuple=True))):
            scores = q[b, heads][h, i] @ k[b, kv_head].T * scale  # (n, Sk), multiplied as the op does
            if mask is not None:
                visible = mask.to(q.device)[i]
            else:
                visible = keys <= i.unsqueeze(-1) if causal else torch.ones_like(scores, dtype=torch.bool)
            rows[h, i] = scores.masked_fill(~visible, float("-inf")).amax(-1) == float("-inf")
    return suspects


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_heads(q, k, v)
    if _scores_hidden_exactly(q, k, mask):
        return reference.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, mask=mask)
    dout, q, k, v, out, lse = _prepare(dout, q, k, v, out, lse)
    return _cpu_bwd(dout, q, k, v, out, lse, 0.0, causal, attn_mask=_additive(mask, q), scale=scale)
