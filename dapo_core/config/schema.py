"""The one typed config of dapo-flow: a pydantic model per concern, checked for consistency at load.

Every field's description names the paper symbol (DAPO, arXiv 2503.14476) and the value of the paper / verl's
DAPO-Qwen2.5-32B script; the defaults are those values unless the field says otherwise. Recipes in `recipes/`
set the rest. Unknown keys are rejected (`extra="forbid"`); impossible combinations fail in
`DapoConfig._check_consistency` with one line per problem giving the value, the rule and the fix.

    from dapo_core.config import load_config
    cfg = load_config(recipe="tiny-dapo", overrides=["trainer.lr=3e-4"])
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field, model_validator

from dapo_core.config.algorithm import (
    AlgorithmConfig,
    DynamicSamplingConfig,
    LossAgg,
    OverlongConfig,
    algorithm_problems,
    norm_length_of,
)
from dapo_core.config.base_model import BaseModelStageConfig, DemosConfig
from dapo_core.config.checks import batch_problems, engine_problems, length_problems
from dapo_core.config.control import ControlConfig
from dapo_core.config.curation import CurationConfig
from dapo_core.config.rollout import RolloutConfig, rollout_problems
from dapo_core.config.section import _Section

__all__ = [  # re-exported
    "AlgorithmConfig",
    "BaseModelStageConfig",
    "CurationConfig",
    "DemosConfig",
    "DynamicSamplingConfig",
    "LossAgg",
    "OverlongConfig",
    "RolloutConfig",
]

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
DEFAULT_ARTIFACT_LOCATION = "./mlartifacts"


class DataConfig(_Section):
    train_files: list[str] = Field(
        default=["outputs/curated/train.parquet"],
        description="Training prompt files (parquet/jsonl). verl DAPO: dapo-math-17k.parquet (DAPO-Math-17k).",
    )
    val_files: list[str] = Field(
        default=["outputs/curated/val.parquet"],
        description="Validation prompt files. verl DAPO: aime-2024.parquet (AIME 2024, avg@32).",
    )
    prompt_key: str = Field(default="prompt", description="Column holding the prompt. verl: prompt.")
    template: str = Field(
        default="dapo",
        description='Prompt template name: "dapo" (the DAPO-Math-17k instruction with the "Answer:" line) or '
        '"tiny" (the CPU arithmetic task).',
    )
    max_prompt_length: int = Field(
        default=2048,
        gt=0,
        description="Max prompt tokens (verl truncates longer prompts on the left). Paper/verl: 2048.",
    )
    max_response_length: int = Field(
        default=20480, gt=0, description="L_max, max generated tokens (Eq. 13). Paper/verl: 20480."
    )
    train_batch_size: int = Field(
        default=512, gt=0, description="B, prompt groups per training step (after filtering). Paper: 512."
    )
    gen_batch_size: int = Field(
        default=1536,
        gt=0,
        description="Prompts per generation batch; dynamic sampling draws these until train_batch_size groups "
        "are kept. verl DAPO-32B: 1536 (3 x 512). Without dynamic sampling keep it equal to train_batch_size.",
    )
    shuffle: bool = Field(default=True, description="Shuffle the training prompts each epoch. verl: true.")
    seed: int | None = Field(default=None, description="Data-order seed; null -> trainer.seed.")


class TinyModelConfig(_Section):
    """The CPU stand-in policy: a Qwen2 architecture built from this config (~1M parameters)."""

    hidden_size: int = Field(default=128, gt=0, description="Hidden width of the tiny Qwen2 model.")
    num_hidden_layers: int = Field(default=4, gt=0, description="Transformer blocks of the tiny model.")
    num_attention_heads: int = Field(default=4, gt=0, description="Query heads; must divide hidden_size.")
    num_key_value_heads: int = Field(default=2, gt=0, description="KV heads (GQA); must divide the query heads.")
    intermediate_size: int = Field(default=512, gt=0, description="MLP width of the tiny model.")
    max_position_embeddings: int = Field(default=256, gt=0, description="Context length of the tiny model.")
    tie_word_embeddings: bool = Field(default=True, description="Share input and output embeddings.")
    rope_theta: float = Field(default=10000.0, gt=0, description="RoPE base frequency.")


class ModelConfig(_Section):
    path: str = Field(
        default="outputs/base_model",
        description="Policy weights: a local HF directory or a hub id. Paper: Qwen/Qwen2.5-32B (base).",
    )
    tokenizer_path: str | None = Field(default=None, description="Tokenizer directory or hub id; null -> path.")
    revision: str | None = Field(default=None, description="Hub revision (branch, tag or commit) of path.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="bfloat16", description="Parameter/compute dtype. verl DAPO-32B: bfloat16."
    )
    trust_remote_code: bool = Field(default=False, description="Allow model code from the hub (off: safer).")
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in backward. verl DAPO-32B: true."
    )
    tiny: TinyModelConfig = Field(
        default_factory=TinyModelConfig, description="Architecture of the CPU stand-in model (tiny recipes)."
    )


class FsdpConfig(_Section):
    """FSDP2 (`torch.distributed.fsdp.fully_shard`) settings of the trainer ranks (trainer.strategy=fsdp2)."""

    param_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16",
        description="Compute/all-gather dtype of the sharded parameters (the fp32 master copy stays sharded). "
        "verl: bfloat16.",
    )
    reduce_dtype: Literal["bfloat16", "float32"] = Field(
        default="float32", description="Gradient reduce-scatter dtype. verl: float32."
    )
    cpu_offload: bool = Field(
        default=False,
        description="Keep sharded parameters, gradients and optimizer state in host memory (slower; fits bigger "
        "models). verl: param_offload / optimizer_offload.",
    )
    reshard_after_forward: bool = Field(
        default=True, description="Free gathered parameters after forward (ZeRO-3); false = ZeRO-2 (more memory)."
    )
    defer_grad_sync: bool = Field(
        default=False,
        description="Reduce-scatter gradients once per mini-batch instead of once per micro-batch: less traffic, "
        "but each rank holds unsharded fp32 gradients of the whole model meanwhile (~4 bytes x parameters).",
    )


class TrainerConfig(_Section):
    total_steps: int = Field(
        default=320, gt=0, description="Rollout (optimizer-facing) steps. Paper: ~5k gradient steps = ~320."
    )
    ppo_epochs: int = Field(default=1, gt=0, description="Passes over each rollout batch. Paper/verl: 1.")
    ppo_mini_batch_size: int = Field(
        default=32, gt=0, description="Prompts per gradient update. Paper: 32 (16 updates per step of 512)."
    )
    micro_batch_size: int = Field(
        default=8, gt=0, description="Responses per forward/backward micro-batch (gradient accumulation)."
    )
    lr: float = Field(default=1e-6, gt=0, description="AdamW learning rate. Paper: 1e-6.")
    lr_warmup_steps: int = Field(
        default=20, ge=0, description="Linear warm-up in rollout steps. Paper: 20 (verl script: 10)."
    )
    lr_scheduler: Literal["constant", "cosine"] = Field(
        default="constant", description="LR schedule after warm-up. Paper: constant."
    )
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1, description="Cosine floor as a fraction of lr (cosine only).")
    weight_decay: float = Field(default=0.1, ge=0, description="AdamW weight decay. verl DAPO: 0.1.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas. verl: (0.9, 0.999).")
    grad_clip: float = Field(default=1.0, gt=0, description="Global gradient-norm clip. verl DAPO: 1.0.")
    save_freq: int = Field(default=25, description="Checkpoint every k steps (<= 0: only at the end). verl: 25.")
    test_freq: int = Field(default=5, description="Validate every k steps; <= 0: no periodic validation. verl: 5.")
    val_before_train: bool = Field(default=True, description="Validate the initial policy. verl DAPO: true.")
    seed: int = Field(default=42, description="Root seed; every sample's seed derives from it.")
    max_ckpt_to_keep: int | None = Field(
        default=None, gt=0, description="Keep only the newest k checkpoints; null = keep all."
    )
    output_dir: str = Field(default="outputs", description="Root of run outputs: <output_dir>/<run_name>/.")
    device: str = Field(default="auto", description='Torch device: "auto" (cuda if present), "cpu", "cuda".')
    strategy: Literal["ddp", "fsdp2"] = Field(
        default="ddp",
        description="Data parallelism of the trainer ranks: ddp (full replicas, gradients all-reduced) or fsdp2 "
        "(fully_shard per decoder layer: parameters, gradients and optimizer state sharded). verl: fsdp.",
    )
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig, description="FSDP2 settings (trainer.strategy=fsdp2).")


class TrackingConfig(_Section):
    uri: str | None = Field(
        default=None, description=f"MLflow tracking URI; null -> {DEFAULT_TRACKING_URI} (env MLFLOW_TRACKING_URI)."
    )
    artifact_location: str | None = Field(
        default=None,
        description=f"MLflow artifact root for new experiments; null -> {DEFAULT_ARTIFACT_LOCATION} beside a local "
        "store, the server's own root (e.g. served by it: mlflow-artifacts:/) with an http(s) tracking URI.",
    )
    experiment: str = Field(default="dapo-flow", description="MLflow experiment name.")
    run_name: str | None = Field(
        default=None, description="MLflow run name and outputs/<run_name>/; null -> <recipe>-<timestamp>."
    )
    log_system_metrics: bool = Field(default=True, description="Log CPU/GPU/memory system metrics to MLflow.")


class ResourcesConfig(_Section):
    executor: Literal["local", "ray"] = Field(
        default="local", description="Run actors in-process (local) or on a Ray cluster. verl: ray."
    )
    ray_address: str | None = Field(
        default=None, description="Ray cluster to join; null -> a local one (env RAY_ADDRESS)."
    )
    num_cpus: int | None = Field(default=2, gt=0, description="CPUs of a local Ray cluster; null = all.")
    nnodes: int = Field(default=1, gt=0, description="Nodes. verl DAPO-32B: 16.")
    n_gpus_per_node: int = Field(default=0, ge=0, description="GPUs per node. verl DAPO-32B: 8.")
    trainer_world_size: int = Field(default=1, gt=0, description="Trainer ranks (FSDP2). verl 32B: 128.")
    rollout_workers: int = Field(default=1, gt=0, description="Rollout engines (one per TP group on GPU).")
    reward_workers: int = Field(default=1, gt=0, description="Reward-scoring worker processes.")
    placement: Literal["colocate", "split"] = Field(
        default="colocate", description="Rollout and trainer on the same GPUs (verl) or separate ones."
    )
    collective_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        description="Timeout of the trainer ranks' collectives (torch.distributed, the NCCL watchdog), also where "
        "the other ranks wait while rank 0 writes an HF export or checkpoint (65-130 GB at 32B). Not the actor "
        "start timeout (300 s).",
    )
    rollout_sleep_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="Colocated vLLM: how long the controller waits for the engines to release their GPU memory "
        "before an update (rollout.mode=one_step_off: behind a generation in flight). Past it the step fails with "
        "an error rather than train while vLLM still holds the memory.",
    )


class EvaluationConfig(_Section):
    """How `dapo evaluate` and the pipeline's evaluate stage score a model (k, T and top_p come from rollout.val_*)."""

    ks: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16, 32],
        description="k values of pass@k / maj@k (those above n are dropped, n is always added).",
    )
    reflection_phrases: list[str] | None = Field(
        default=None,
        description="Phrases counted by the reflection rate (whole words, any case); null = the built-in list "
        "(wait, let me check, verify, re-examine, double-check, ...).",
    )
    seed: int | None = Field(default=None, description="Sampling seed; null = derived from trainer.seed.")
    metrics_path: str = Field(default="metrics/eval.json", description="Where `dvc metrics show` reads the results.")


class DapoConfig(_Section):
    """The whole resolved configuration of one run (see `dapo_core.config.load_config`)."""

    recipe: str = Field(description="Name of the recipe (or config file) this config came from.")
    data: DataConfig = Field(
        default_factory=DataConfig, description="Prompt files, template, lengths, batch sizes (curate, train)."
    )
    model: ModelConfig = Field(
        default_factory=ModelConfig, description="Policy model and the tiny CPU stand-in (base model, train)."
    )
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="Sampling for training and validation; engines (train, evaluate)."
    )
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig,
        description="DAPO / GRPO objective, reward, filtering, shaping (train).",
    )
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig, description="Optimizer, steps, checkpoints, validation cadence (train)."
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="MLflow store, experiment and run name (every stage)."
    )
    resources: ResourcesConfig = Field(
        default_factory=ResourcesConfig,
        description="Local or Ray execution, GPUs and placement (train, evaluate).",
    )
    curation: CurationConfig = Field(
        default_factory=CurationConfig, description="Sources, split and synthetic raw data (curate)."
    )
    base_model: BaseModelStageConfig = Field(
        default_factory=BaseModelStageConfig, description="Warm start of the tiny CPU model (base_model)."
    )
    evaluation: EvaluationConfig = Field(
        default_factory=EvaluationConfig, description="pass@k list, reflection phrases, metrics file (evaluate)."
    )
    control: ControlConfig = Field(
        default_factory=ControlConfig, description="The supervised controls RL is compared with (pipeline, ablation)."
    )

    @model_validator(mode="after")
    def _check_consistency(self) -> DapoConfig:
        problems = [
            *batch_problems(self),
            *algorithm_problems(self.algorithm),
            *rollout_problems(self),
            *length_problems(self),
            *engine_problems(self),
        ]
        if problems:
            # One line per problem; the loader turns these into a ConfigError.
            raise ValueError("\n".join(problems))
        return self


def resolved_run_name(cfg: DapoConfig, now: datetime | None = None) -> str:
    """`tracking.run_name`, or `<recipe>-<YYYYmmdd-HHMMSS>` at `now` (default: the current local time)."""
    if cfg.tracking.run_name:
        return cfg.tracking.run_name
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return f"{cfg.recipe}-{stamp}"


def resolved_tracking_uri(cfg: DapoConfig) -> str:
    """`tracking.uri`, or the local SQLite store `sqlite:///mlflow.db`."""
    return cfg.tracking.uri or DEFAULT_TRACKING_URI


def resolved_artifact_location(cfg: DapoConfig) -> str | None:
    """`tracking.artifact_location`; else None with a tracking server (http(s), databricks: the server's own
    artifact root, so the artifacts reach it, e.g. through `--serve-artifacts`), else `./mlartifacts`."""
    if cfg.tracking.artifact_location:
        return cfg.tracking.artifact_location
    if resolved_tracking_uri(cfg).startswith(("http://", "https://", "databricks")):
        return None
    return DEFAULT_ARTIFACT_LOCATION


def resolved_max_new_tokens(cfg: DapoConfig) -> int:
    """`rollout.max_new_tokens`, or L_max = `data.max_response_length`."""
    return cfg.rollout.max_new_tokens or cfg.data.max_response_length


def resolved_data_seed(cfg: DapoConfig) -> int:
    """`data.seed`, or `trainer.seed`."""
    return cfg.trainer.seed if cfg.data.seed is None else cfg.data.seed


def resolved_norm_length(cfg: DapoConfig) -> int | None:
    """Dr. GRPO's constant for `seq-mean-token-sum-norm` (default L_max); None for every other mode."""
    return norm_length_of(cfg.algorithm, cfg.data.max_response_length)
