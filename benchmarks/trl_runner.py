"""TRL's GRPOTrainer on the project's base model and prompts: the other side of ``benchmarks.bench_trl``.

Runs inside the benchmark's own virtualenv (``.venv-trl``: TRL is never a project dependency), from the project
root, so it scores with the project's own rule reward (``dapo_core.rewards.math_dapo_score``) rather than a copy:

    .venv-trl/bin/python -m benchmarks.trl_runner --settings SETTINGS.json --out DIR

``SETTINGS.json`` is written by ``bench_trl`` (the shared settings). Writes ``DIR/final`` (an HF model directory
that ``dapo evaluate`` loads, with the project's tokenizer files) and ``DIR/steps.json``: the wall time of every
RL step (one generation batch and its ``updates`` optimizer steps), measured between step ends by a callback.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, str(Path.cwd()))  # the project root: its scorer
from benchmarks.trl_settings import trl_config_kwargs
from dapo_core.rewards import math_dapo_score


class StepClock(TrainerCallback):
    """Wall time of each RL step: an optimizer step closes an RL step every ``updates`` steps."""

    def __init__(self, updates: int) -> None:
        self.updates = updates
        self.last = time.perf_counter()
        self.steps: list[float] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.last = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.updates == 0:
            now = time.perf_counter()
            self.steps.append(now - self.last)
            self.last = now


def reward(prompts: list[str], completions: list[str], ground_truth: list[str], **_: Any) -> list[float]:
    """The project's rule reward (+1 / -1 on the "Answer: X" line)."""
    return [float(math_dapo_score(c, g)["score"]) for c, g in zip(completions, ground_truth, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    s = json.loads(args.settings.read_text())
    torch.set_num_threads(s["threads"])

    # AutoTokenizer would pick Qwen2's tokenizer class for this config; the project's is a plain fast tokenizer
    tok = PreTrainedTokenizerFast.from_pretrained(s["model"])
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    frame = pd.read_parquet(s["train_file"])
    rows = [
        {
            "prompt": tok.apply_chat_template(list(p), tokenize=False, add_generation_prompt=True),
            "ground_truth": str(rm["ground_truth"]),
        }
        for p, rm in zip(frame["prompt"], frame["reward_model"], strict=True)
    ]
    config = GRPOConfig(**trl_config_kwargs(s, args.out))  # the shared settings (benchmarks.trl_settings)
    clock = StepClock(s["updates"])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        callbacks=[clock],
    )
    trainer.train()
    final = args.out / "final"
    model.save_pretrained(final)
    tok.save_pretrained(final)
    for name in ("chat_template.jinja", "tokenizer_config.json", "generation_config.json"):
        if (Path(s["model"]) / name).exists():  # keep the project's tokenizer markers and chat template
            shutil.copy(Path(s["model"]) / name, final / name)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    (args.out / "steps.json").write_text(json.dumps({"step_s": clock.steps, "train_reward": rewards}, indent=1))


if __name__ == "__main__":
    main()
