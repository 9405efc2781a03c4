"""One typed, validated config (pydantic) and the recipe loader.

    from dapo_core.config import load_config, flatten_config
    cfg = load_config(recipe="tiny-dapo", overrides=["trainer.total_steps=2"])
    cfg.algorithm.clip_high        # 0.28
    flatten_config(cfg)            # {"data.train_batch_size": "32", ...} for MLflow params

The knob reference, generated from the schema and the recipes, is docs/recipe-knobs.md.
"""

from dapo_core.config.base_model import MOVED_KEYS
from dapo_core.config.loader import (
    DEFAULT_CONFIG,
    ConfigError,
    available_recipes,
    check_dotted_key,
    config_from_dict,
    deep_merge,
    find_recipe,
    load_config,
    recipe_dirs,
    recipe_summary,
    validate_section,
)
from dapo_core.config.schema import (
    AlgorithmConfig,
    BaseModelStageConfig,
    CurationConfig,
    DapoConfig,
    DataConfig,
    DemosConfig,
    DynamicSamplingConfig,
    LossAgg,
    ModelConfig,
    OverlongConfig,
    ResourcesConfig,
    RolloutConfig,
    TinyModelConfig,
    TrackingConfig,
    TrainerConfig,
    resolved_artifact_location,
    resolved_data_seed,
    resolved_max_new_tokens,
    resolved_norm_length,
    resolved_run_name,
    resolved_tracking_uri,
)
from dapo_core.config.serialize import dump_yaml, flatten_config, unflatten_config

__all__ = [
    "DEFAULT_CONFIG",
    "MOVED_KEYS",
    "AlgorithmConfig",
    "BaseModelStageConfig",
    "ConfigError",
    "CurationConfig",
    "DapoConfig",
    "DataConfig",
    "DemosConfig",
    "DynamicSamplingConfig",
    "LossAgg",
    "ModelConfig",
    "OverlongConfig",
    "ResourcesConfig",
    "RolloutConfig",
    "TinyModelConfig",
    "TrackingConfig",
    "TrainerConfig",
    "available_recipes",
    "check_dotted_key",
    "config_from_dict",
    "deep_merge",
    "dump_yaml",
    "find_recipe",
    "flatten_config",
    "load_config",
    "recipe_dirs",
    "recipe_summary",
    "resolved_artifact_location",
    "resolved_data_seed",
    "resolved_max_new_tokens",
    "resolved_norm_length",
    "resolved_run_name",
    "resolved_tracking_uri",
    "unflatten_config",
    "validate_section",
]
