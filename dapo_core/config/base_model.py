"""The ``base_model`` section: the warm start of the tiny CPU model (``dapo_core.warmstart``).

Split out of ``dapo_core.config.schema`` (which re-exports it). Every knob of the warm start and its default live
here: the warm start's settings (``dapo_core.warmstart.sft.WarmStartConfig``) are this section plus the seed and
the generation length, never a copy of it. The ranges are Field constraints; the loader turns a violation into one
"key (value) rule: fix" line.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dapo_core.config.section import _Section


class DemosConfig(_Section):
    """``base_model.demos``: the warm start's demonstrations, an unlimited stream of worked solutions by default.

    The knobs limit it to a fixed set (``num_demos``), make its hard part scarce (``scarce_from_ops``,
    ``scarce_demos``) or give a share of it a habit: answering first (``shortcut_*``), going on to the next
    problem (``run_on_*``), checking each line (``check_frac``). The supervised controls see the same stream.
    """

    min_ops: int = Field(default=1, ge=1, description="Fewest operations of the SFT problems.")
    max_ops: int = Field(default=4, ge=1, description="Most operations of the SFT problems.")
    num_demos: int | None = Field(
        default=None,
        ge=1,
        description="Demonstrations the warm start may see: a fixed set of this many worked solutions, cycled in "
        "epochs (null = a fresh problem every step). RL trains on the curated problems (answers only) either way.",
    )
    scarce_from_ops: int | None = Field(
        default=None,
        ge=1,
        description="Problems with this many operations or more are scarce: their demonstrations are a fixed set of "
        "`scarce_demos` worked solutions (null = every operation count has an unlimited supply).",
    )
    scarce_demos: int = Field(
        default=0, ge=0, description="Size of the fixed set of worked solutions of the scarce (hard) problems."
    )
    shortcut_frac: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Share of the demonstrations that state the answer line (`Answer: N`) without working it out "
        "first (see `shortcut_style`), as web data mixes worked and bare answers: the warm start then answers "
        "before working that often.",
    )
    shortcut_style: Literal["answer_only", "answer_first"] = Field(
        default="answer_only",
        description="How a shortcut demonstration looks: `answer_only` = the answer line alone; `answer_first` = "
        "the answer line, then the worked lines (the same tokens of work, stated after the answer).",
    )
    run_on_frac: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Share of the demonstrations that do not stop after their answer line but go on to the next "
        "problem (`Q: ...` and its worked solution), as worksheets and documents of many problems do: the warm "
        "start then often keeps writing after it has answered, and the scorer reads the last answer line.",
    )
    run_on_style: Literal["worked", "answer_only"] = Field(
        default="worked",
        description="What follows the next question in a run-on demonstration: its worked solution (`worked`) or "
        "its answer line only (`answer_only`: a short run-on, no second worked solution in one response).",
    )
    check_frac: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Share of the demonstrations that check each worked line (`check 6*57=342`) before their "
        "answer line: the warm start then checks that often, so the response length is the policy's choice, and "
        "with checks every 4-operation answer and 93% of 3-operation ones pass 80 tokens (a length limit the hard "
        "problems hit; without checks the longest is 61).",
    )

    @model_validator(mode="after")
    def _check_ranges(self) -> DemosConfig:
        problems = []
        if self.min_ops > self.max_ops:
            problems.append(
                f"base_model.demos.min_ops ({self.min_ops}) must be <= max_ops ({self.max_ops}): the problems have "
                "min_ops to max_ops operations; lower min_ops or raise max_ops"
            )
        if self.scarce_from_ops is not None:
            if self.scarce_from_ops > self.max_ops:
                problems.append(
                    f"base_model.demos.scarce_from_ops ({self.scarce_from_ops}) must be <= max_ops ({self.max_ops}): "
                    "no problem would be scarce; lower it, or null for no scarce part"
                )
            if self.scarce_demos < 1:
                problems.append(
                    f"base_model.demos.scarce_demos ({self.scarce_demos}) must be >= 1 worked solutions of problems "
                    f"with >= {self.scarce_from_ops} operations when scarce_from_ops is set (to show none, lower "
                    "max_ops instead)"
                )
        if problems:
            raise ValueError("\n".join(problems))  # the loader turns each line into one problem of a ConfigError
        return self


MOVED_KEYS: dict[str, str] = {f"base_model.{name}": f"base_model.demos.{name}" for name in DemosConfig.model_fields}
"""Keys nested under base_model.demos by issue 44: an old flat key is an error that names its new place."""


class BaseModelStageConfig(_Section):
    """The warm start of the tiny CPU model (the `base_model` stage): SFT on the synthetic task's worked solutions,
    the stand-in for a pretrained base model. Real recipes skip this stage and name an HF model in model.path."""

    steps: int = Field(
        default=1000, gt=0, description="SFT optimizer steps: the cap, and the length of the cosine schedule."
    )
    time_budget_s: float | None = Field(
        default=None, gt=0, description="Stop earlier after this many seconds (null = off; breaks determinism)."
    )
    lr: float = Field(
        default=1e-3, gt=0, description="Peak SFT learning rate (linear warm-up, cosine decay); 3e-3 is erratic here."
    )
    warmup_steps: int = Field(default=100, ge=0, description="Linear warm-up steps of the SFT schedule.")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="Cosine floor as a fraction of lr.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay during SFT.")
    grad_clip: float = Field(default=1.0, gt=0, description="Gradient-norm clip during SFT.")
    batch_size: int = Field(default=64, gt=0, description="Problems per SFT step.")
    micro_batch_size: int = Field(default=64, gt=0, description="Problems per forward/backward micro-batch.")
    demos: DemosConfig = Field(
        default_factory=DemosConfig,
        description="Which demonstrations the warm start sees: operation counts, limited and scarce sets, habits.",
    )
    target_greedy_acc: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Stop once greedy accuracy on a probe set (disjoint from the held-out problems) reaches this; "
        "null = always run `steps`. Deterministic: the check happens at fixed steps.",
    )
    check_every: int = Field(default=100, gt=0, description="Steps between target checks (target_greedy_acc).")
    check_from: int = Field(default=0, ge=0, description="First step at which the target is checked.")
    probe_size: int = Field(default=200, gt=0, description="Problems of the probe set used by the target check.")
    heldout_size: int = Field(default=200, ge=0, description="Held-out problems for the stage's own accuracy check.")
    heldout_k: int = Field(default=8, gt=0, description="Samples per held-out problem (k >= 8: k=4 is noisy).")
    log_every: int = Field(default=10, gt=0, description="Log SFT metrics every k steps.")
