"""A lean decode loop with a static KV cache for small Llama-family decoders (``rollout.hf_decode: static``).

Why: on a CPU, ``model.generate`` on the ~1M-parameter tiny model spends most of each decode step in per-token
Python and framework work (cache objects, mask construction, logits processors, stopping criteria), not in
arithmetic. This loop does only what one step needs, on the same module's weights, read at every call (so weight
syncs and in-place updates are seen at once; only the fused q/k/v and gate/up matrices are concatenated per call):

- the KV cache is preallocated once per call: per layer ``(b, H_kv, P + T, D)`` for keys and values, and step t
  writes slot ``P + t``; attention reads the view ``[:, :, :P + t + 1]`` (no concatenation, no reallocation);
- rotary cos/sin are computed once per call for every position the call can reach, with the model's own rotary
  module (the same floats generate uses), and gathered per step;
- the padding mask is built once: left-padded prompt slots are masked, generated slots never are;
- the next-token logits go to a ``choose(step, logits) -> tokens`` callback (``SeededSampler.choose``: the same
  per-row Gumbel streams, temperature, top-k/top-p and log-prob record as the generate path), and finished rows
  are fed the pad token, as generate does.

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
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x (b, H, s, D); cos, sin (b, 1, s, D)
    return x * cos + _rotate_half(x) * sin


class _Layer:
    """One decoder layer's weights, read from the live module (the fused q/k/v and gate/up matrices: copies)."""

    def __init__(self, layer: Any, head_dim: int) -> None:
        attn: Any = layer.self_attn
        mlp: Any = layer.mlp
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm
        q, k, v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.down, self.act = mlp.down_proj, mlp.act_fn
        # one GEMM for q, k, v and one for gate, up (fewer, larger calls; copies of the weights for this call only)
        self.qkv_weight = torch.cat([q.weight, k.weight, v.weight])  # (H*D + 2*Hkv*D, d)
        biases = [q.bias, k.bias, v.bias]
        self.qkv_bias = torch.cat(biases) if all(b is not None for b in biases) else None
        self.qkv_split = [q.weight.shape[0], k.weight.shape[0], v.weight.shape[0]]
        if any(b is not None for b in biases) and self.qkv_bias is None:
            raise ValueError("q/k/v projections with biases on some but not all: not a Qwen2/Llama layer")
        self.gate_up_weight = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # (2*I, d)
        if mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
            raise ValueError("MLP projections with biases: not a Qwen2/Llama layer")
        self.head_dim = head_dim
        self.scaling = float(getattr(attn, "scaling", head_dim**-0.5))

    def __call__(
        self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, start: int, mask: Tensor
    ) -> Tensor:
        # x (b, s, d); cos/sin (b, 1, s, D); caches (b, H_kv, P+T, D); slots [start, start+s) are written;
        # mask (b, 1, s, start+s) bool, True = may attend
        b, s, _ = x.shape
        h = _rms_norm(self.ln1, x)
        q, k, v = F.linear(h, self.qkv_weight, self.qkv_bias).split(self.qkv_split, dim=-1)
        q = q.reshape(b, s, -1, self.head_dim).transpose(1, 2)  # (b, H, s, D)
        k = k.reshape(b, s, -1, self.head_dim).transpose(1, 2)  # (b, Hkv, s, D)
        v = v.reshape(b, s, -1, self.head_dim).transpose(1, 2)  # (b, Hkv, s, D)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k_cache[:, :, start : start + s] = k
        v_cache[:, :, start : start + s] = v
        keys, values = k_cache[:, :, : start + s], v_cache[:, :, : start + s]  # (b, Hkv, start+s, D) views
        if s == 1:  # decode: grouped heads as one batched matmul (CPU SDPA is ~10x slower for one query)
            n_kv = keys.shape[1]
            qg = q.reshape(b, n_kv, -1, self.head_dim)  # (b, Hkv, g, D): query head h reads kv head h // g
            scores = torch.matmul(qg, keys.transpose(-1, -2)) * self.scaling  # (b, Hkv, g, S)
            scores = scores.masked_fill(~mask[:, :, 0:1, :], float("-inf"))  # mask (b, 1, 1, S)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)  # (b, Hkv, g, S)
            attn = torch.matmul(probs, values).reshape(b, 1, -1)  # (b, 1, H*D)
        else:
            attn = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=keys.shape[1] != q.shape[1]
            )  # (b, H, s, D)
            attn = attn.transpose(1, 2).reshape(b, s, -1)  # (b, s, H*D)
        x = x + F.linear(attn, self.o.weight, self.o.bias)
        h = _rms_norm(self.ln2, x)
        gate, up = F.linear(h, self.gate_up_weight).chunk(2, dim=-1)  # (b, s, I) each
        return x + F.linear(self.act(gate) * up, self.down.weight, self.down.bias)  # (b, s, d)


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
    cos_table, sin_table = cos_table[0], sin_table[0]  # (S, D)

    # prefill each distinct prompt once (the G samples of a prompt share it), then give every row its copy
    unique, inverse = torch.unique(torch.cat([input_ids, real.long()], dim=1), dim=0, return_inverse=True)
    u_ids, u_real, u_pos = unique[:, :width], unique[:, width:].bool(), prompt_pos[_first_rows(inverse)]
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()  # (P, P)
    eye = torch.eye(width, dtype=torch.bool, device=device)
    # causal over the prompt, pads masked (a pad query attends to itself only: no all-masked row, no NaN)
    prefill_mask = ((causal[None] & u_real[:, None, :]) | eye[None])[:, None]  # (u, 1, P, P)
    x = inner.embed_tokens(u_ids)  # (u, P, d)
    cos, sin = cos_table[u_pos][:, None], sin_table[u_pos][:, None]  # (u, 1, P, D)
    keys, values = [], []
    for layer in layers:
        k_u = torch.empty((unique.shape[0], n_kv, total, head_dim), dtype=dtype, device=device)
        v_u = torch.empty_like(k_u)
        x = layer(x, cos, sin, k_u, v_u, 0, prefill_mask)
        keys.append(k_u[inverse])  # (b, Hkv, P+T, D)
        values.append(v_u[inverse])
    last = x[inverse, -1:]  # (b, 1, d)
    key_ok = torch.ones((b, total), dtype=torch.bool, device=device)  # (b, P+T): generated slots always attend
    key_ok[:, :width] = real

    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=device)
    out = torch.full((b, max_new_tokens), pad_token_id, dtype=torch.long, device=device)  # (b, T)
    active = torch.arange(b, device=device)  # rows still generating; the others are dropped from the batch
    logits = torch.zeros((b, int(lm_head.weight.shape[0])), dtype=torch.float32, device=device)  # (b, V)
    finished = torch.zeros(b, dtype=torch.bool, device=device)  # (a,) per active row: has emitted an EOS
    steps = 0
    mask_rows = key_ok  # (a, P+T): key_ok of the active rows (re-gathered after each compaction)
    for step in range(max_new_tokens):
        head = F.linear(_rms_norm(inner.norm, last[:, 0]), lm_head.weight, lm_head.bias).float()  # (a, V)
        if active.numel() == b:  # no row dropped yet: no gather / scatter
            token = choose(step, head)
        else:
            logits[active] = head
            token = choose(step, logits)[active]  # (a,): the sampler draws every row's noise: streams stay aligned
        if active.numel() == b:
            out[:, step] = token
        else:
            out[active, step] = token
        steps = step + 1
        finished = finished | torch.isin(token, eos)  # (a,)
        n_running = int((~finished).sum())
        if step + 1 == max_new_tokens or n_running == 0:
            break
        if n_running <= _COMPACT_AT * active.numel():  # drop finished rows (copies the caches once)
            keep = (~finished).nonzero().squeeze(1)
            active, token, last, finished = active[keep], token[keep], last[keep], finished[keep]
            keys = [k[keep] for k in keys]
            values = [v[keep] for v in values]
            mask_rows = key_ok[active]
        slot = width + step
        x = inner.embed_tokens(token[:, None])  # (a, 1, d)
        pos = response_pos[active, step]  # (a,)
        cos, sin = cos_table[pos][:, None, None], sin_table[pos][:, None, None]  # (a, 1, 1, D)
        # a finished row not yet dropped keeps running on a pad token; its later tokens are overwritten below
        mask = mask_rows[:, None, None, : slot + 1]  # (a, 1, 1, slot+1)
        for i, layer in enumerate(layers):
            x = layer(x, cos, sin, keys[i], values[i], slot, mask)
        last = x
    return _pad_after_eos(out[:, :steps], eos, pad_token_id)  # (b, t)


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
