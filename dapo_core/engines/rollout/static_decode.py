"""A lean decode loop with a static KV cache for small Llama-family decoders (``rollout.hf_decode: static``).

Why: on a CPU, ``model.generate`` on the ~1M-parameter tiny model spends most of each decode step in per-token
Python and framework work (cache objects, mask construction, logits processors, stopping criteria), not in
arithmetic. This loop does only what one step needs, on the same module's weights, read at every call (so weight
syncs and in-place updates are seen at once; only the fused q/k/v and gate/up matrices are concatenated per call):

- the KV cache is allocated once per call, per layer ``(nb, b, H_kv, R, D)`` for keys and values: blocks of
  ``R = _BLOCK`` slots, block-major, so the blocks read at a step are one stretch of memory without gaps. Step t
  writes slot ``s = P + t`` at ``[s // R, :, :, s % R]``, and attention reads the first ``s // R + 1`` blocks
  whole, slots not yet written masked. (The earlier row-major ``(b, H_kv, P + T, D)`` cache read the view
  ``[:, :, :s + 1]``: each row's slots with a gap to the next row's, and MKL's batched GEMMs ran 2.6-3x slower on
  that than on the same bytes without gaps, measured on this CPU);
- rotary cos/sin are computed once per call for every position the call can reach, with the model's own rotary
  module (the same floats generate uses), kept as one complex table and gathered per step; the q/k weight rows
  are put in RoPE's pair order and q's are pre-scaled by 1/sqrt(D) once per call, so a step's RoPE is one complex
  multiply of all q and k heads and its scores need no scaling (``_Layer``);
- the padding mask is an additive bias (0 / -inf per key slot; left-padded prompt slots and slots not yet
  written are masked; a slot turns 0 when it is written) that the score GEMM adds (``baddbmm``);
- the distinct prompts are prefilled once and their cache slots copied to each sample's row; finished rows are
  dropped from the cache once a quarter of it has stopped (``_COMPACT_AT``; only the blocks written so far are
  copied); until then they skip every GEMM and stay only in the attention batch (q = 0, read by no one);
- the next-token logits go to a ``choose(step, logits) -> tokens`` callback (``SeededSampler.choose``: the same
  per-row Gumbel streams, temperature, top-k/top-p and log-prob record as the generate path); a finished row's
  later slots get the pad token, as generate emits.

Equations per layer (Qwen2 / Llama; x: (b, s, d)):
    h = x + W_o · Attn(RoPE(W_q·n1(x) + b_q), RoPE(W_k·n1(x) + b_k), W_v·n1(x) + b_v)
    y = h + W_down · (act(W_gate · n2(h)) ⊙ W_up · n2(h)),   n(x) = w ⊙ x / sqrt(mean(x²) + eps)
then logits = W_lm · n_final(y) at the last position only.

Supported: ``model_type`` qwen2 or llama, full attention (no sliding window), default RoPE, and an
``act_fn`` on the MLP. Anything else raises ``ValueError`` naming ``rollout.hf_decode: generate`` as the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")

# choose(step, logits (b, V) float32) -> next tokens (b,) long
ChooseFn = Callable[[int, Tensor], Tensor]
# drop finished rows from the decode batch once at most this share of it is still running
_COMPACT_AT = 0.75
# KV-cache slots per block (see _Layer.decode)
_BLOCK = 16


def check_supported(model: nn.Module) -> None:
    """Raise ``ValueError`` (what, why, fix) unless ``model`` is a decoder this loop computes exactly."""
    config: Any = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    problems = []
    if model_type not in SUPPORTED_MODEL_TYPES:
        problems.append(f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    elif getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        problems.append("sliding-window attention is on")
    else:
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
        if rope_type != "default":
            problems.append(f"rope_type {rope_type!r} (only 'default' is computed here)")
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
            problems.append("it lacks the model.rotary_emb / lm_head layout of transformers' Llama-family classes")
    if problems:
        raise ValueError(
            f"rollout.hf_decode=static cannot decode this model: {'; '.join(problems)}. "
            "Set rollout.hf_decode: generate (transformers' generate handles every architecture)."
        )


def _rms_norm(norm: Any, x: Tensor) -> Tensor:
    """Qwen2RMSNorm / LlamaRMSNorm: in float32, then back to the input dtype, times the weight."""
    if x.dtype == torch.float32:  # one fused kernel, the same floats as the module's five ops
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(x.dtype)


def _add_linear(x: Tensor, h: Tensor, linear: Any) -> Tensor:
    """``x + linear(h)``: one ``addmm`` (the residual added by the GEMM) for 2-D rows and no bias."""
    if x.dim() == 2 and linear.bias is None:
        return torch.addmm(x, h, linear.weight.t())
    return x + F.linear(h, linear.weight, linear.bias)


def _pair_order(rows: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """Reorder each head's output rows of a q/k projection from RoPE's halves (x_0..x_{D/2-1}, x_{D/2}..x_{D-1})
    to pairs (x_0, x_{D/2}, x_1, x_{D/2+1}, ...), so a complex view pairs the two coordinates RoPE rotates
    together. q and k get the same order, so q . k (the only use of either) is the same sum."""
    half = head_dim // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=-1).flatten()  # (D,)
    return rows.unflatten(0, (n_heads, head_dim))[:, order].flatten(0, 1)


def _rotate_pairs(pairs: Tensor, rot: Tensor) -> Tensor:
    """RoPE in pair order: ``pairs`` (..., n, D/2, 2) as complex numbers times ``rot`` (..., 1, D/2) complex;
    returns (..., n, D). float32/64: one complex multiply; other dtypes: the same products in real arithmetic."""
    if pairs.dtype in (torch.float32, torch.float64):
        complex_dtype = torch.complex128 if pairs.dtype == torch.float64 else torch.complex64
        return torch.view_as_real(torch.view_as_complex(pairs) * rot.to(complex_dtype)).flatten(-2)
    cos, sin = rot.real.to(pairs.dtype), rot.imag.to(pairs.dtype)
    x, y = pairs[..., 0], pairs[..., 1]  # the coordinates i and i + D/2 of RoPE's halves
    return torch.stack([x * cos - y * sin, y * cos + x * sin], dim=-1).flatten(-2)


class _Layer:
    """One decoder layer's weights, read from the live module (the fused q/k/v and gate/up matrices: copies).

    Per call, the q rows are pre-multiplied by the softmax scale and the q/k rows put in RoPE's pair order
    (``_pair_order``): RoPE is then one complex multiply of q and k together, and the scores need no scaling.
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
                _pair_order(q.weight * scaling, self.n_heads, head_dim),
                _pair_order(k.weight, self.n_kv, head_dim),
                v.weight,
            ]
        )
        self.qkv_bias = None
        if q.bias is not None:
            self.qkv_bias = torch.cat(
                [
                    _pair_order(q.bias * scaling, self.n_heads, head_dim),
                    _pair_order(k.bias, self.n_kv, head_dim),
                    v.bias,
                ]
            )
        self.gate_up_weight = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # (2*I, d)
        if mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
            raise ValueError("MLP projections with biases: not a Qwen2/Llama layer")

    def _qkv(self, x: Tensor, rot: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # x (..., d); rot (..., 1, D/2) complex: cos + i sin of each position -> q (..., H, D), k and v (..., Hkv, D)
        qkv = F.linear(_rms_norm(self.ln1, x), self.qkv_weight, self.qkv_bias)  # (..., (H + 2*Hkv) * D)
        n_qk = (self.n_heads + self.n_kv) * self.head_dim
        qk = _rotate_pairs(qkv[..., :n_qk].unflatten(-1, (-1, self.head_dim // 2, 2)), rot)  # (..., H+Hkv, D)
        v = qkv[..., n_qk:].unflatten(-1, (self.n_kv, self.head_dim))  # (..., Hkv, D)
        return qk[..., : self.n_heads, :], qk[..., self.n_heads :, :], v

    def _mlp(self, x: Tensor) -> Tensor:
        gate, up = F.linear(_rms_norm(self.ln2, x), self.gate_up_weight).chunk(2, dim=-1)  # (..., I) each
        return _add_linear(x, self.act(gate) * up, self.down)

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
        return self._mlp(_add_linear(x, attn, self.o))  # (l, d)


@torch.inference_mode()
def decode_static(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    max_new_tokens: int,
    choose: ChooseFn,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
) -> Tensor:
    """Generate up to ``max_new_tokens`` tokens per row; returns the responses ``(b, t)``, t <= max_new_tokens.

    ``input_ids`` / ``attention_mask``: ``(b, P)`` left-padded prompts. A row stops after its first EOS; later
    slots hold ``pad_token_id`` and the loop ends when every row has stopped (t is then the longest response).
    """
    check_supported(model)
    inner: Any = model.model
    config: Any = model.config
    b, width = input_ids.shape
    device = input_ids.device
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    n_kv = int(config.num_key_value_heads)
    layers = [_Layer(layer, head_dim) for layer in inner.layers]
    total = width + max_new_tokens
    dtype = inner.embed_tokens.weight.dtype
    lm_head: Any = model.lm_head

    real = attention_mask.to(device=device, dtype=torch.bool)  # (b, P)
    # positions: prompt tokens count from 0 at the first real token (pads: 0), response tokens continue
    prompt_pos = (real.long().cumsum(dim=1) - 1).clamp(min=0)  # (b, P)
    response_pos = real.long().sum(dim=1, keepdim=True) + torch.arange(max_new_tokens, device=device)  # (b, T)
    table = torch.arange(int(response_pos.max()) + 1 if max_new_tokens else width, device=device)[None]  # (1, S)
    cos_table, sin_table = inner.rotary_emb(inner.embed_tokens.weight[:1][None], table)  # (1, S, D) each
    rot_table = _rotation_table(cos_table[0], sin_table[0])  # (S, D/2) complex: cos + i sin

    # prefill each distinct prompt once (the G samples of a prompt share it), then give every row its copy
    unique, inverse = torch.unique(torch.cat([input_ids, real.long()], dim=1), dim=0, return_inverse=True)
    u_ids, u_real, u_pos = unique[:, :width], unique[:, width:].bool(), prompt_pos[_first_rows(inverse)]
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()  # (P, P)
    eye = torch.eye(width, dtype=torch.bool, device=device)
    # causal over the prompt, pads masked (a pad query attends to itself only: no all-masked row, no NaN)
    prefill_mask = ((causal[None] & u_real[:, None, :]) | eye[None])[:, None]  # (u, 1, P, P)
    x = inner.embed_tokens(u_ids)  # (u, P, d)
    rot = rot_table[u_pos][:, :, None]  # (u, P, 1, D/2)
    n_blocks = -(-total // _BLOCK)  # the cache in blocks of _BLOCK slots (see _Layer.decode)
    keys, values = [], []
    for layer in layers:
        k_u = torch.empty((unique.shape[0], n_kv, width, head_dim), dtype=dtype, device=device)
        v_u = torch.empty_like(k_u)
        x = layer.prefill(x, rot, k_u, v_u, prefill_mask)
        keys.append(_prompt_blocks(k_u, inverse, n_blocks))  # (nb, b, Hkv, R, D)
        values.append(_prompt_blocks(v_u, inverse, n_blocks))
    last = x[inverse, -1]  # (b, d)
    # additive attention bias per key slot: 0 = may attend, -inf = a left-padded prompt slot or a slot not yet
    # written (each generated slot turns 0 when it is written)
    key_bias = torch.full((b, n_blocks * _BLOCK), float("-inf"), dtype=dtype, device=device)  # (b, nb*R)
    key_bias[:, :width].masked_fill_(real, 0.0)
    bias_blocks = (  # (nb, a, Hkv, 1, R): per block, row and kv head
        key_bias.view(b, n_blocks, 1, 1, _BLOCK).transpose(0, 1).expand(-1, -1, n_kv, -1, -1).contiguous()
    )

    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=device)
    out = torch.full((b, max_new_tokens), pad_token_id, dtype=torch.long, device=device)  # (b, T)
    active = torch.arange(b, device=device)  # rows still generating; the others are dropped from the batch
    logits = torch.zeros((b, int(lm_head.weight.shape[0])), dtype=torch.float32, device=device)  # (b, V)
    finished = torch.zeros(b, dtype=torch.bool, device=device)  # (a,) per active row: has emitted an EOS
    steps = 0
    for step in range(max_new_tokens):
        head = F.linear(_rms_norm(inner.norm, last), lm_head.weight, lm_head.bias).float()  # (a, V)
        if active.numel() == b:  # no row dropped yet: no gather / scatter
            token = choose(step, head)
            out[:, step] = token
        else:
            logits[active] = head
            token = choose(step, logits)[active]  # (a,): the sampler draws every row's noise: streams stay aligned
            out[active, step] = token
        steps = step + 1
        finished = finished | torch.isin(token, eos)  # (a,)
        n_running = int((~finished).sum())
        if step + 1 == max_new_tokens or n_running == 0:
            break
        slot = width + step
        block, place = divmod(slot, _BLOCK)
        if n_running <= _COMPACT_AT * active.numel():  # drop finished rows (copies the written blocks once)
            keep = (~finished).nonzero().squeeze(1)
            active, token, last, finished = active[keep], token[keep], last[keep], finished[keep]
            written = -(-slot // _BLOCK)  # blocks holding the slots written so far
            keys = [_take_rows(k, keep, written) for k in keys]
            values = [_take_rows(v, keep, written) for v in values]
            bias_blocks = bias_blocks.index_select(1, keep)
        if place == 0:  # a block entered: its unwritten slots must read as zeros (masked, and 0 * 0 in the sums)
            for cache in keys + values:
                cache[block].zero_()
        bias_blocks[block, :, :, :, place] = 0.0
        # a finished row not yet dropped stays in the cache and the attention, but its GEMMs are skipped (its
        # `last` goes stale; its later tokens are overwritten below)
        live = None if n_running == active.numel() else (~finished).nonzero().squeeze(1)  # (l,) cache rows
        x = inner.embed_tokens(token if live is None else token[live])  # (l, d)
        rot = rot_table[response_pos[active if live is None else active[live], step]][:, None]  # (l, 1, D/2)
        bias = bias_blocks[: block + 1].view(-1, 1, _BLOCK)  # (n*a*Hkv, 1, R)
        for i, layer in enumerate(layers):
            x = layer.decode(x, rot, keys[i], values[i], slot, bias, live)
        last = x if live is None else last.index_copy_(0, live, x)  # (a, d)
    return _pad_after_eos(out[:, :steps], eos, pad_token_id)  # (b, t)


def _prompt_blocks(cache: Tensor, rows: Tensor, n_blocks: int) -> Tensor:
    """The decode cache (n_blocks, len(rows), Hkv, R, D) whose row r holds prompt row ``rows[r]`` of ``cache``
    (u, Hkv, P, D) in slots [0, P); the rest of the prompt's last block is zero, later blocks are not initialised
    (the loop zeroes a block when it enters it)."""
    _, n_kv, width, head_dim = cache.shape
    n_prompt = -(-width // _BLOCK)
    padded = F.pad(cache, (0, 0, 0, n_prompt * _BLOCK - width))  # (u, Hkv, n_prompt*R, D)
    # block-major per distinct prompt first (u rows), then one gather of whole rows into the cache
    blocks = padded.view(-1, n_kv, n_prompt, _BLOCK, head_dim).permute(2, 0, 1, 3, 4).contiguous()  # (np, u, ...)
    out = cache.new_empty((n_blocks, rows.numel(), n_kv, _BLOCK, head_dim))
    torch.index_select(blocks, 1, rows, out=out[:n_prompt])
    return out


def _take_rows(blocks: Tensor, rows: Tensor, written: int) -> Tensor:
    """A new cache (nb, len(rows), Hkv, R, D) holding ``blocks``' rows ``rows``; only the ``written`` blocks that
    hold slots written so far are copied (later ones are zeroed when the loop enters them)."""
    out = blocks.new_empty((blocks.shape[0], rows.numel(), *blocks.shape[2:]))
    torch.index_select(blocks[:written], 1, rows, out=out[:written])
    return out


def _rotation_table(cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE's cos/sin tables (S, D), whose two halves are equal (default RoPE), as one complex table (S, D/2)."""
    half = cos.shape[-1] // 2
    if not (torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])):
        raise ValueError(
            "rollout.hf_decode=static: the rotary tables' two halves differ (not the default RoPE layout). "
            "Set rollout.hf_decode: generate."
        )
    real = torch.float64 if cos.dtype == torch.float64 else torch.float32  # bfloat16/half tables: exact in float32
    return torch.complex(cos[:, :half].to(real), sin[:, :half].to(real))


def _first_rows(inverse: Tensor) -> Tensor:
    """For each unique value u, the first row index whose inverse is u."""
    rows = torch.arange(inverse.numel(), device=inverse.device)
    first = torch.full((int(inverse.max()) + 1,), inverse.numel(), dtype=torch.long, device=inverse.device)
    return first.scatter_reduce(0, inverse, rows, reduce="amin")


def _pad_after_eos(out: Tensor, eos: Tensor, pad_token_id: int) -> Tensor:
    """Every slot after a row's first EOS becomes ``pad_token_id`` (what generate emits for finished rows)."""
    is_eos = torch.isin(out, eos)  # (b, t)
    after = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0  # strictly after the first EOS
    return out.masked_fill(after, pad_token_id)
