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
  multiply of all q and k heads and its scores need no scaling (``StaticLayer``);
- the padding mask is an additive bias (0 / -inf per key slot; left-padded prompt slots and slots not yet
  written are masked; a slot turns 0 when it is written) that the score GEMM adds (``baddbmm``);
- the distinct prompts are prefilled once and their cache slots copied to each sample's row; finished rows are
  dropped from the cache once a quarter of it has stopped (``_COMPACT_AT``; only the blocks written so far are
  copied); until then they skip every GEMM and stay only in the attention batch (q = 0, read by no one);
- the next-token logits go to a ``choose(step, logits) -> tokens`` callback (``SeededSampler.choose``: the same
  per-row Gumbel streams, temperature, top-k/top-p and log-prob record as the generate path); a finished row's
  later slots get the pad token, as generate emits.

The layer's equations and weights: ``static_layer.StaticLayer``.

Supported: ``model_type`` qwen2 or llama, full attention (no sliding window), default RoPE, and an
``act_fn`` on the MLP. Anything else raises ``ValueError`` naming ``rollout.hf_decode: generate`` as the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dapo_core.engines.rollout.static_layer import StaticLayer, rms_norm

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")

# choose(step, logits (b, V) float32) -> next tokens (b,) long
ChooseFn = Callable[[int, Tensor], Tensor]
# drop finished rows from the decode batch once at most this share of it is still running
_COMPACT_AT = 0.75
# KV-cache slots per block (see StaticLayer.decode)
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
    width, device = input_ids.shape[1], input_ids.device
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    layers = [StaticLayer(layer, head_dim) for layer in inner.layers]
    real = attention_mask.to(device=device, dtype=torch.bool)  # (b, P)
    # positions: prompt tokens count from 0 at the first real token (pads: 0), response tokens continue
    prompt_pos = (real.long().cumsum(dim=1) - 1).clamp(min=0)  # (b, P)
    response_pos = real.long().sum(dim=1, keepdim=True) + torch.arange(max_new_tokens, device=device)  # (b, T)
    rot_table = _model_rotations(inner, response_pos, width, max_new_tokens)  # (S, D/2) complex
    cache, last = _prefill(
        inner, layers, input_ids, real, prompt_pos, rot_table,
        n_kv=int(config.num_key_value_heads), head_dim=head_dim, total=width + max_new_tokens,
    )  # fmt: skip
    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=device)
    out = torch.full((input_ids.shape[0], max_new_tokens), pad_token_id, dtype=torch.long, device=device)  # (b, T)
    steps = _decode(model, layers, cache, last, out, response_pos, rot_table, choose=choose, eos=eos, width=width)
    return _pad_after_eos(out[:, :steps], eos, pad_token_id)  # (b, t)


def _model_rotations(inner: Any, response_pos: Tensor, width: int, max_new_tokens: int) -> Tensor:
    """The model's own rotary cos/sin for every position the call can reach, as one complex table (S, D/2)."""
    device = response_pos.device
    table = torch.arange(int(response_pos.max()) + 1 if max_new_tokens else width, device=device)[None]  # (1, S)
    cos_table, sin_table = inner.rotary_emb(inner.embed_tokens.weight[:1][None], table)  # (1, S, D) each
    return _rotation_table(cos_table[0], sin_table[0])  # (S, D/2) complex: cos + i sin


class _Cache:
    """The decode KV cache of every layer, ``(nb, a, Hkv, R, D)`` keys and values in blocks of R = ``_BLOCK``
    slots, and the additive attention bias per block, row and kv head ``(nb, a, Hkv, 1, R)``: 0 = may attend,
    -inf = a left-padded prompt slot or a slot not yet written (each generated slot turns 0 when it is written)."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], bias_blocks: Tensor) -> None:
        self.keys, self.values, self.bias_blocks = keys, values, bias_blocks

    def keep_rows(self, keep: Tensor, slot: int) -> None:
        """Drop every row not in ``keep``: copies only the blocks holding the slots before ``slot``."""
        written = -(-slot // _BLOCK)  # blocks holding the slots written so far
        self.keys = [_take_rows(k, keep, written) for k in self.keys]
        self.values = [_take_rows(v, keep, written) for v in self.values]
        self.bias_blocks = self.bias_blocks.index_select(1, keep)

    def open_slot(self, slot: int) -> Tensor:
        """Make ``slot`` readable; returns the bias (n*a*Hkv, 1, R) of the n blocks a step at ``slot`` reads."""
        block, place = divmod(slot, _BLOCK)
        if place == 0:  # a block entered: its unwritten slots must read as zeros (masked, and 0 * 0 in the sums)
            for cache in self.keys + self.values:
                cache[block].zero_()
        self.bias_blocks[block, :, :, :, place] = 0.0
        return self.bias_blocks[: block + 1].view(-1, 1, _BLOCK)


def _prefill(
    inner: Any,
    layers: list[StaticLayer],
    input_ids: Tensor,
    real: Tensor,
    prompt_pos: Tensor,
    rot_table: Tensor,
    *,
    n_kv: int,
    head_dim: int,
    total: int,
) -> tuple[_Cache, Tensor]:
    """Prefill each distinct prompt once (the G samples of a prompt share it), then give every row its copy:
    the cache, sized for ``total`` slots, and each row's last hidden state (b, d)."""
    b, width = input_ids.shape
    device, dtype = input_ids.device, inner.embed_tokens.weight.dtype
    unique, inverse = torch.unique(torch.cat([input_ids, real.long()], dim=1), dim=0, return_inverse=True)
    u_ids, u_real, u_pos = unique[:, :width], unique[:, width:].bool(), prompt_pos[_first_rows(inverse)]
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()  # (P, P)
    eye = torch.eye(width, dtype=torch.bool, device=device)
    # causal over the prompt, pads masked (a pad query attends to itself only: no all-masked row, no NaN)
    prefill_mask = ((causal[None] & u_real[:, None, :]) | eye[None])[:, None]  # (u, 1, P, P)
    x = inner.embed_tokens(u_ids)  # (u, P, d)
    rot = rot_table[u_pos][:, :, None]  # (u, P, 1, D/2)
    n_blocks = -(-total // _BLOCK)  # the cache in blocks of _BLOCK slots (see StaticLayer.decode)
    keys, values = [], []
    for layer in layers:
        k_u = torch.empty((unique.shape[0], n_kv, width, head_dim), dtype=dtype, device=device)
        v_u = torch.empty_like(k_u)
        x = layer.prefill(x, rot, k_u, v_u, prefill_mask)
        keys.append(_prompt_blocks(k_u, inverse, n_blocks))  # (nb, b, Hkv, R, D)
        values.append(_prompt_blocks(v_u, inverse, n_blocks))
    key_bias = torch.full((b, n_blocks * _BLOCK), float("-inf"), dtype=dtype, device=device)  # (b, nb*R)
    key_bias[:, :width].masked_fill_(real, 0.0)
    bias_blocks = (  # (nb, a, Hkv, 1, R): per block, row and kv head
        key_bias.view(b, n_blocks, 1, 1, _BLOCK).transpose(0, 1).expand(-1, -1, n_kv, -1, -1).contiguous()
    )
    return _Cache(keys, values, bias_blocks), x[inverse, -1]  # last: (b, d)


def _decode(
    model: Any,
    layers: list[StaticLayer],
    cache: _Cache,
    last: Tensor,
    out: Tensor,
    response_pos: Tensor,
    rot_table: Tensor,
    *,
    choose: ChooseFn,
    eos: Tensor,
    width: int,
) -> int:
    """The decode loop after the prefill: each step chooses the next tokens into ``out`` (b, T) from the rows' last
    hidden states ``last`` (b, d), then runs the running rows' new tokens through the layers at cache slot
    ``width + step``; returns the number of steps taken."""
    b, max_new_tokens = out.shape
    active = torch.arange(b, device=out.device)  # rows still generating; the others are dropped from the batch
    logits = torch.zeros((b, int(model.lm_head.weight.shape[0])), dtype=torch.float32, device=out.device)  # (b, V)
    finished = torch.zeros(b, dtype=torch.bool, device=out.device)  # (a,) per active row: has emitted an EOS
    steps = 0
    for step in range(max_new_tokens):
        token = _choose_tokens(model, last, step, choose, active, logits, out)  # (a,)
        steps = step + 1
        finished = finished | torch.isin(token, eos)  # (a,)
        n_running = int((~finished).sum())
        if step + 1 == max_new_tokens or n_running == 0:
            break
        slot = width + step
        if n_running <= _COMPACT_AT * active.numel():  # drop finished rows (copies the written blocks once)
            keep = (~finished).nonzero().squeeze(1)
            active, token, last, finished = active[keep], token[keep], last[keep], finished[keep]
            cache.keep_rows(keep, slot)
        bias = cache.open_slot(slot)  # (n*a*Hkv, 1, R)
        # a finished row not yet dropped stays in the cache and the attention, but its GEMMs are skipped (its
        # `last` goes stale; its later tokens are overwritten by _pad_after_eos)
        live = None if n_running == active.numel() else (~finished).nonzero().squeeze(1)  # (l,) cache rows
        rot = rot_table[response_pos[active if live is None else active[live], step]][:, None]  # (l, 1, D/2)
        x = model.model.embed_tokens(token if live is None else token[live])  # (l, d)
        for i, layer in enumerate(layers):
            x = layer.decode(x, rot, cache.keys[i], cache.values[i], slot, bias, live)
        last = x if live is None else last.index_copy_(0, live, x)  # (a, d)
    return steps


def _choose_tokens(
    model: Any, last: Tensor, step: int, choose: ChooseFn, active: Tensor, logits: Tensor, out: Tensor
) -> Tensor:
    """The next token of each active row (a,) from its last hidden state (a, d), written to ``out[:, step]``."""
    inner, lm_head = model.model, model.lm_head
    head = F.linear(rms_norm(inner.norm, last), lm_head.weight, lm_head.bias).float()  # (a, V)
    if active.numel() == out.shape[0]:  # no row dropped yet: no gather / scatter
        token = choose(step, head)
        out[:, step] = token
    else:
        logits[active] = head
        token = choose(step, logits)[active]  # (a,): the sampler draws every row's noise: streams stay aligned
        out[active, step] = token
    return token


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
