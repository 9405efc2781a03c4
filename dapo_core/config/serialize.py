"""A config written out and read back: YAML and flat dotted strings (``dapo config show [--flat]``).

The flat form is what a run logs as its MLflow params; ``unflatten_config`` reads it back into an equal config:

    flatten_config(cfg)["algorithm.clip_high"]    # "0.28"
    unflatten_config(flatten_config(cfg)) == cfg  # True
"""

from __future__ import annotations

import json
import typing
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import BaseModel

from dapo_core.config.loader import (
    check_dotted_key,
    config_from_dict,
    is_union,
    parse_yaml_value,
    section_at,
    set_dotted,
)
from dapo_core.config.schema import DapoConfig


def dump_yaml(cfg: DapoConfig) -> str:
    """The config as YAML, one commented section per concern in schema order; `load_config` reads it back equal."""
    blocks = []
    for name, value in cfg.model_dump(mode="json").items():
        text = yaml.safe_dump({name: value}, sort_keys=False, default_flow_style=False, width=110)
        description = DapoConfig.model_fields[name].description
        blocks.append(f"# {name}: {description}\n{text}" if isinstance(value, dict) and description else text)
    return "\n".join(blocks)


def flat_items(model: BaseModel, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf field of ``model`` (a config or one of its sections), in field order."""
    items: list[tuple[str, Any]] = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        key = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            items.extend(flat_items(value, key + "."))
        else:
            items.append((key, value))
    return items


def flatten_config(cfg: DapoConfig) -> dict[str, str]:
    """Dotted keys -> strings (MLflow params): strings as-is, everything else as JSON (`null`, `[0.9, 0.999]`)."""
    return {
        key: value if isinstance(value, str) else json.dumps(list(value) if isinstance(value, tuple) else value)
        for key, value in flat_items(cfg)
    }


def _is_text(annotation: Any) -> bool:
    args = typing.get_args(annotation)
    if annotation is str:
        return True
    if typing.get_origin(annotation) is typing.Literal:
        return all(isinstance(a, str) for a in args)
    return is_union(annotation) and any(_is_text(a) for a in args if a is not type(None))


def unflatten_config(flat: Mapping[str, str]) -> DapoConfig:
    """Inverse of `flatten_config` (a text field holding exactly "null" reads back as None when optional)."""
    data: dict[str, Any] = {}
    for key, text in flat.items():
        check_dotted_key(key)
        *parents, leaf = key.split(".")
        section = section_at(parents)
        field = section.model_fields[leaf] if section else None
        optional = field is not None and type(None) in typing.get_args(field.annotation)
        if field is not None and _is_text(field.annotation):
            value: Any = None if (optional and text == "null") else text
        else:
            try:
                value = json.loads(text)
            except ValueError:  # written by hand rather than by flatten_config
                value = parse_yaml_value(text)
        set_dotted(data, key, value)
    return config_from_dict(data, source="flattened config")
