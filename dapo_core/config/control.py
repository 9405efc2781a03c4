"""The ``control`` section: the supervised controls that RL's gains are measured against.

``sft-control`` continues the warm start on its own demonstrations for RL's training time; ``sft-control-clean``
on clean ones (``dapo_core.warmstart.control``). `dapo ablation` runs them as the ladder's closing rungs; with
``control.pipeline``, `dapo pipeline` runs them after RL and prints them beside the policy.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dapo_core.config.section import _Section

CONTROL_NAMES: tuple[str, ...] = ("sft-control", "sft-control-clean")


class ControlConfig(_Section):
    """The supervised controls: the base model given RL's training time of more SFT instead (`dapo ablation`'s
    control rungs; the pipeline's comparison with `pipeline`)."""

    pipeline: list[Literal["sft-control", "sft-control-clean"]] = Field(
        default_factory=list,
        description="Controls `dapo pipeline` trains after RL, each for the CPU seconds RL's steps took, and "
        "evaluates beside the policy: `sft-control` continues SFT on the warm start's demonstrations (habits "
        "included), `sft-control-clean` on clean ones that stop at their answer line. [] = none (the controls "
        "continue the tiny warm start: CPU recipes only).",
    )
    lr: float | None = Field(
        default=None,
        gt=0,
        description="sft-control's lr; null = where the warm start's schedule ended (base_model.lr * min_lr_ratio).",
    )
    clean_lr: float | None = Field(
        default=None,
        gt=0,
        description="sft-control-clean's lr (tune it on the probe set); null = control.lr.",
    )
