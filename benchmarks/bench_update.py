"""Policy-update throughput of ``PolicyTrainer.update`` vs a bare forward+backward loop, plus matmul roofline/MFU.

Run: ``python -m benchmarks.bench_update`` (writes benchmarks/results/update.json and update.md).
Both loops see the same tiny Qwen2 (default tiny recipe dims), the same batch and micro-batch size, and take one
AdamW step per mini-batch; the ratio is what the DAPO bookkeeping (clipped loss, global denominators, entropy and
clip diagnostics) costs. Goal: >= 0.8x.
"""

from __future__ import annotations

import torch

from benchmarks.common import best_of, matmul_gflops, random_policy_batch, write_results
from dapo_core.algorithm import log_probs_from_logits, masked_sum
from dapo_core.config import AlgorithmConfig, TrainerConfig
from dapo_core.engines.batch import split_by_groups, split_rows
from dapo_core.engines.models import build_tiny_qwen2
from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
from dapo_core.engines.trainer import LossConfig, OptimConfig, PolicyTrainer

GROUPS, G, PROMPT_LEN, RESP_LEN, MICRO, MINI_GROUPS = 32, 8, 12, 40, 64, 8


def main() -> None:
    torch.manual_seed(0)
    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    model = build_tiny_qwen2(tok)
    n_params = sum(p.numel() for p in model.parameters())
    batch = random_policy_batch(
        groups=GROUPS, g=G, prompt_len=PROMPT_LEN, resp_len=RESP_LEN, vocab=len(tok), pad=tok.pad_token_id
    )
    optim = OptimConfig.from_config(TrainerConfig(lr=1e-5, weight_decay=0.0, lr_warmup_steps=0))
    loss = LossConfig.from_config(AlgorithmConfig(clip_c=None), max_response_length=RESP_LEN)  # no dual clip
    trainer = PolicyTrainer(model, optim, micro_batch_size=MICRO)
    batch.old_log_probs, _ = trainer.compute_log_probs(batch)
    tokens = int(batch.attention_mask.sum())

    def ours() -> None:
        trainer.update(batch, loss, ppo_epochs=1, mini_batch_groups=MINI_GROUPS)

    bare_opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def bare() -> None:
        model.train()
        for mini in split_by_groups(batch, MINI_GROUPS):
            bare_opt.zero_grad()
            n_tok = mini.response_mask.sum()
            for mb in split_rows(mini, MICRO):
                logits = model(
                    input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids
                ).logits[:, mb.prompt_width - 1 : -1]
                lp = log_probs_from_logits(logits, mb.responses)
                loss = -masked_sum(lp * mb.advantages.unsqueeze(-1), mb.response_mask) / n_tok
                loss.backward()
            bare_opt.step()

    # interleave to share the machine's noise fairly
    t_ours, t_bare = [], []
    for _ in range(3):
        t_ours.append(best_of(ours, repeats=1, warmup=0 if t_ours else 1))
        t_bare.append(best_of(bare, repeats=1, warmup=0 if t_bare else 1))
    ours_tps, bare_tps = tokens / min(t_ours), tokens / min(t_bare)
    gflops = matmul_gflops()
    # fwd+bwd ~ 6 FLOPs per parameter per token (attention is negligible at these lengths)
    achieved = 6 * n_params * tokens / min(t_ours) / 1e9
    payload = {
        "params": n_params,
        "tokens_per_update": tokens,
        "ours_tokens_per_s": ours_tps,
        "bare_tokens_per_s": bare_tps,
        "ratio": ours_tps / bare_tps,
        "goal_ratio": 0.8,
        "matmul_gflops_fp32": gflops,
        "achieved_gflops": achieved,
        "mfu": achieved / gflops,
        "setup": {"groups": GROUPS, "G": G, "prompt_len": PROMPT_LEN, "max_resp_len": RESP_LEN, "micro": MICRO},
    }
    table = "\n".join(
        [
            "| measure | value |",
            "|---|---|",
            f"| PolicyTrainer.update tokens/s | {ours_tps:,.0f} |",
            f"| bare forward+backward tokens/s | {bare_tps:,.0f} |",
            f"| ratio (goal >= 0.8) | {ours_tps / bare_tps:.2f} |",
            f"| fp32 matmul GFLOP/s (1024^3) | {gflops:,.1f} |",
            f"| achieved GFLOP/s (6*params*tokens) | {achieved:,.1f} |",
            f"| MFU | {achieved / gflops:.1%} |",
        ]
    )
    write_results("update", payload, table)


if __name__ == "__main__":
    main()
