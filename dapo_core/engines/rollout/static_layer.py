"""One decoder layer of the static decode loop (``static_decode``), computed from the live module's weights.

Equations per layer (Qwen2 / Llama; x: (b, s, d)):
    h = x + W_o · Attn(RoPE(W_q·n1(x) + b_q), RoPE(W_k·n1(x) + b_k), W_v·n1(x) + b_v)
    y = h + W_down · (act(W_gate · n2(h)) ⊙ W_up · n2(h)),   n(x) = w ⊙ x / sqrt(mean(x²) + eps)
then logits = W_lm · n_final(y) at the last position only.

The q/k weight rows are put in RoPE's pair order (``pair_order``) and q's pre-scaled by 1/sqrt(D) once per call,
so a step's RoPE is one complex multiply of all q and k heads (``rotate_pairs``) and its scores need no scaling.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(norm: Any, x: Tensor) -> Tensor:
    """Qwen2RMSNorm / LlamaRMSNorm: in float32, then back to the input dtype, times the weight."""
    if x.dtype == torch.float32:  # one fused kernel, the same floats as the module's five ops
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(x.dtype)


def add_linear(x: Tensor, h: Tensor, linear: Any) -> Tensor:
    """``x + linear(h)``: one ``addmm`` (the residual added by the GEMM) for 2-D rows and no bias."""
    if x.dim() == 2 and linear.bias is None:
        return torch.addmm(x, h, linear.weight.t())
    return x + F.linear(h, linear.weight, linear.bias)


def pair_order(rows: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """Reorder each head's output rows of a q/k projection from RoPE's halves (x_0..x_{D/2-1}, x_{D/2}..x_{D-1})
    to pairs (x_0, x_{D/2}, x_1, x_{D/2+1}, ...), so a complex view pairs the two coordinates RoPE rotates
    together. q and k get the same order, so q . k (the only use of either) is the same sum."""
    half = head_dim // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=-1).flatten()  # (D,)
    return rows.unflatten(0, (n_heads, head_dim))[:, order].flatten(0, 1)


def rotate_pairs(pairs: Tensor, rot: Tensor) -> Tensor:
    """RoPE in pair order: ``pairs`` (..., n, D/2, 2) as complex numbers times ``rot`` (..., 1, D/2) complex;
    returns (..., n, D). float32/64: one complex multiply; other dtypes: the same products in real arithmetic."""
    if pairs.dtype in (torch.float32, torch.float64):
        complex_dtype = torch.complex128 if pairs.dtype == torch.float64 else torch.complex64
        return torch.view_as_real(torch.view_as_complex(pairs) * rot.to(complex_dtype)).flatten(-2)
    cos, sin = rot.real.to(pairs.dtype), rot.imag.to(pairs.dtype)
    x, y = pairs[..., 0], pairs[..., 1]  # the coordinates i and i + D/2 of RoPE's halves
    return torch.stack([x * cos - y * sin, y * cos + x * sin], dim=-1).flatten(-2)


class StaticLayer:
    """One decoder layer's weights, read from the live module (the fused q/k/v and gate/up matrices: copies).

    Per call, the q rows are pre-multiplied by the softmax scale and the q/k rows put in RoPE's pair order
    (``pair_order``): RoPE is then one complex multiply of q and k together, and the scores need no scaling.
    """

    def __init__(self, layer: Any, head_dim: int) -> None:
        attn: Any = layer.self_attn
        mlp: Any = layer.mlp
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm
        q, k, v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.down, self.act = mlp.down_proj, mlp.act_fn
        self.head_dim = head_dim
        scaling = float(getattr(attn, "scaling", head_dim**-0.5))
        self.n_heads, self.n_kv = q.weight.shape[0] // head_dim, k.weight.shape[0] // head_dim
        biases = [q.bias, k.bias, v.bias]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            raise ValueError("q/k/v projections with biases on some but not all: not a Qwen2/Llama layer")
        # one GEMM for q, k, v and one for gate, up (fewer, larger calls; copies of the weights for this call only)
        self.qkv_weight = torch.cat(  # (H*D + 2*Hkv*D, d)
            [
                pair_order(q.weight * scaling, self.n_heads, head_dim),
                pair_order(k.weight, self.n_kv, head_dim),
                v.weight,
            ]
        )
        self.qkv_bias = None
        if q.bias is not None:
            self.qkv_bias = torch.cat(
                [
                    pair_order(q.bias * scaling, self.n_heads, head_dim),
                    pair_order(k.bias, self.n_kv, head_dim),
                    v.bias,
                ]
            )
        self.gate_up_weight = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # (2*I, d)
        if mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
            raise ValueError("MLP projections with biases: not a Qwen2/Llama layer")

    def _qkv(self, x: Tensor, rot: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # x (..., d); rot (..., 1, D/2) complex: cos + i sin of each position -> q (..., H, D), k and v (..., Hkv, D)
        qkv = F.linear(rms_norm(self.ln1, x), self.qkv_weight, self.qkv_bias)  # (..., (H + 2*Hkv) * D)
        n_qk = (self.n_heads + self.n_kv) * self.head_dim
        qk = rotate_pairs(qkv[..., :n_qk].unflatten(-1, (-1, self.head_dim // 2, 2)), rot)  # (..., H+Hkv, D)
        v = qkv[..., n_qk:].unflatten(-1, (self.n_kv, self.head_dim))  # (..., Hkv, D)
        return qk[..., : self.n_heads, :], qk[..., self.n_heads :, :], v

    def _mlp(self, x: Tensor) -> Tensor:
        gate, up = F.linear(rms_norm(self.ln2, x), self.gate_up_weight).chunk(2, dim=-1)  # (..., I) each
        return add_linear(x, self.act(gate) * up, self.down)

    def prefill(self, x: Tensor, rot: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor) -> Tensor:
        # x (b, s, d); rot (b, s, 1, D/2); caches (b, Hkv, P, D): slots [0, s) are written; mask (b, 1, s, s)
        b, s, _ = x.shape
        q, k, v = self._qkv(x, rot)  # (b, s, H|Hkv, D)
        k_cache[:, :, :s] = k.transpose(1, 2)
        v_cache[:, :, :s] = v.transpose(1, 2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k_cache[:, :, :s],
            v_cache[:, :, :s],
            attn_mask=mask,
            scale=1.0,
            enable_gqa=self.n_kv != self.n_heads,
        )  # (b, H, s, D)
        x = x + F.linear(attn.transpose(1, 2).reshape(b, s, -1), self.o.weight, self.o.bias)  # (b, s, d)
        return self._mlp(x)

    def decode(
        self, x: Tensor, rot: Tensor, k_blocks: Tensor, v_blocks: Tensor, slot: int, bias: Tensor, live: Tensor | None
    ) -> Tensor:
        # x (l, d): one new token per running row at cache slot `slot`; rot (l, 1, D/2); caches (nb, a, Hkv, R, D)
        # in blocks of R slots (slot s: block s // R, place s % R); live (l,): the cache rows of x's rows (None:
        # all a rows); bias (n*a*Hkv, 1, R) over the n = slot // R + 1 blocks read: 0 where a key may be read,
        # -inf where not (left-padded prompt slots, slots not yet written)
        a, size, n_kv, head_dim = k_blocks.shape[1], k_blocks.shape[3], self.n_kv, self.head_dim
        q, k, v = self._qkv(x, rot)  # (l, H|Hkv, D)
        block, place = divmod(slot, size)
        if live is None:
            k_blocks[block, :, :, place] = k
            v_blocks[block, :, :, place] = v
        else:  # a finished row's slot is not written: only its own attention reads it, and that output is dropped
            k_blocks[block, :, :, place][live] = k  # (index_put_ on the view: ~1.5x index_copy_'s speed here)
            v_blocks[block, :, :, place][live] = v
            q = q.new_zeros((a, *q.shape[1:])).index_copy_(0, live, q)  # (a, H, D): attention runs on every row
        n, rows, g = block + 1, a * n_kv, self.n_heads // n_kv
        # every block read whole: its (a*Hkv, R, D) rows lie end to end in memory (a prefix of the cache read
        # without gaps runs ~2-3x faster than rows with gaps on this CPU); the G query heads of a kv head are rows
        keys = k_blocks[:n].view(n * rows, size, head_dim)  # (n*a*Hkv, R, D)
        values = v_blocks[:n].view(n * rows, size, head_dim)
        queries = q.reshape(1, rows, g, head_dim).expand(n, rows, g, head_dim).reshape(n * rows, g, head_dim)
        scores = torch.baddbmm(bias, queries, keys.transpose(1, 2))  # (n*a*Hkv, g, R)
        scores = scores.view(n, rows, g, size).permute(1, 2, 0, 3).reshape(rows, g, n * size)  # (a*Hkv, g, n*R)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
        probs = probs.view(rows, g, n, size).permute(2, 0, 1, 3).reshape(n * rows, g, size)  # (n*a*Hkv, g, R)
        attn = torch.bmm(probs, values).view(n, a, -1).sum(dim=0)  # (a, H*D): the blocks' shares summed
        if live is not None:
            attn = attn.index_select(0, live)  # (l, H*D)
        return self._mlp(add_linear(x, attn, self.o))  # (l, d)
