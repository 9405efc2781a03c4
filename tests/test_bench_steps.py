"""The pieces the overhead and scaling benchmarks stand on: the training step with and without Prefect task runs
is the same step, the least-squares fit, and the 32B projection's arithmetic."""

from __future__ import annotations

import math

import torch
from prefect import flow
from train_fixtures import make_train_cfg

import flows.train as flow_module
from benchmarks.bench_scaling import fit
from benchmarks.projection import Assumptions, project
from benchmarks.steps import StepRunner
from dapo_core.engines.executor import LocalExecutor
from tasks import train as task_module
from tasks.train import load_prompts

SAME_KEYS = ("train/acc/mean", "train/num_gen_batches", "actor/pg_loss", "actor/grad_norm", "actor/ppo_kl")


def test_a_step_without_task_runs_is_the_same_step(tmp_path):
    cfg = make_train_cfg(tmp_path)
    a, b = LocalExecutor(cfg), LocalExecutor(cfg)
    items = load_prompts.fn(cfg.data.train_files, a.tokenizer, cfg.data.max_prompt_length, "data.train_files")
    plain, tasked = StepRunner(a, cfg, items), StepRunner(b, cfg, items)

    @flow(name="bench-steps-test")
    def both() -> tuple[dict[str, float], dict[str, float]]:
        _, m_plain = plain.step(with_tasks=False)
        assert flow_module.T is task_module  # put back after the plain step
        _, m_tasked = tasked.step(with_tasks=True)
        return m_plain, m_tasked

    m_plain, m_tasked = both()
    for key in SAME_KEYS:
        assert m_plain[key] == m_tasked[key], key
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    moved = LocalExecutor(cfg).model.state_dict()
    assert any(not torch.equal(moved[k], v) for k, v in a.model.state_dict().items())  # the step did update


def test_fit_recovers_a_line_and_scores_scatter():
    a, b, r2 = fit([1.0, 2.0, 4.0, 8.0], [0.5 + 0.25 * x for x in (1.0, 2.0, 4.0, 8.0)])
    assert (round(a, 6), round(b, 6), round(r2, 6)) == (0.5, 0.25, 1.0)
    _, _, r2_noisy = fit([1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 2.0, 4.0])
    assert 0.0 < r2_noisy < 0.9


def test_projection_arithmetic():
    a = Assumptions()
    p = project(a)
    trained = a.train_prompts * a.n * (a.mean_prompt_tokens + a.mean_response_tokens)
    assert p["trained_tokens_per_step"] == trained
    ctx = a.mean_prompt_tokens + a.mean_response_tokens / 2
    attn = 4 * a.layers * a.q_heads * a.head_dim * ctx
    assert math.isclose(p["train_flops"], trained * (10 * a.params + 5 * attn))
    assert p["generated_tokens_per_step"] == a.gen_prompts * a.n * a.mean_response_tokens * a.gen_batches_per_step
    assert p["label"].startswith("PROJECTION")
    # on a GPU with unbounded compute the decode step is bound by memory traffic instead
    fast = project(Assumptions(peak_tflops=1e6))
    assert (p["decode_bound"], fast["decode_bound"]) == ("compute", "memory")
    assert fast["generation_s"] < p["generation_s"]
    # twice the GPUs: the training part halves
    assert math.isclose(project(Assumptions(gpus=256))["train_s"], p["train_s"] / 2, rel_tol=0.01)
