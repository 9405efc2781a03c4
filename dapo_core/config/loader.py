"""Resolve a `DapoConfig` from a YAML file or a recipe, the environment and `--set` overrides.

Resolution, lowest first:
1. the YAML file (`config_path`, default `params.yaml` in the cwd) OR `recipes/<recipe>.yaml` (never both);
   a file may `inherit: <recipe>` (deep-merged, cycles detected);
2. the environment: `MLFLOW_TRACKING_URI` -> tracking.uri, `RAY_ADDRESS` -> resources.ray_address;
3. each override `a.b.c=value` (value parsed as YAML), in order.

Every problem surfaces as a `ConfigError` (a ValueError) with one line per problem: the dotted key, the value,
the rule and the fix; never a raw pydantic dump.

    python -c "from dapo_core.config import load_config, dump_yaml; print(dump_yaml(load_config(recipe='tiny-dapo')))"
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from dapo_core.config.base_model import MOVED_KEYS
from dapo_core.config.schema import DapoConfig

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = "params.yaml"
PACKAGE_RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
# the environment a `make stack` worker (or a shell after `eval "$(dapo stack env)"`) gives every run
ENV_OVERRIDES: dict[str, str] = {
    "MLFLOW_TRACKING_URI": "tracking.uri",
    "RAY_ADDRESS": "resources.ray_address",
    "DAPO_EXECUTOR": "resources.executor",
}
INHERIT_KEY = "inherit"
M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """An invalid config: one readable line per problem (dotted key, value, rule, fix)."""

    def __init__(self, problems: Sequence[str] | str, source: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        head = f"{source}: " if source else ""
        if len(self.problems) == 1:
            message = head + self.problems[0]
        else:
            message = f"{head}{len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


# ---------------- YAML: 1e-6 is a float, duplicate keys are errors, errors name file:line ----------------


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-6` as a float (YAML 1.2) and rejects duplicate keys."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def parse_yaml_value(text: str) -> Any:
    """Parse one `--set` value as a YAML scalar or flow collection (`8`, `1e-5`, `[a, b]`, `null`, `true`)."""
    return yaml.load(text, Loader=_Loader) if text.strip() else None


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping; syntax errors become `ConfigError` naming `file:line:column`."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(
            f"config file {path} not found: pass --config PATH, or --recipe NAME with one of: "
            + ", ".join(available_recipes())
        ) from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        detail = "; ".join(str(part) for part in (exc.context, exc.problem) if part)
        raise ConfigError(f"invalid YAML: {detail}: fix the syntax at that line", source=where) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {exc}", source=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"top level must be a mapping of sections, got {type(data).__name__}: write `data:`, `trainer:` ...",
            source=str(path),
        )
    return data


# ---------------- recipes: lookup, inheritance ----------------


def recipe_dirs() -> list[Path]:
    """Where recipes are looked up, in order: `./recipes/`, then the repository's `recipes/`."""
    dirs = [Path.cwd() / "recipes", PACKAGE_RECIPES_DIR]
    return [d for i, d in enumerate(dirs) if d.resolve() not in {e.resolve() for e in dirs[:i]}]


def available_recipes() -> list[str]:
    """Names of all recipes found in `recipe_dirs()`, sorted."""
    return sorted({p.stem for d in recipe_dirs() if d.is_dir() for p in d.glob("*.yaml")})


def find_recipe(name: str) -> Path:
    """Path of recipe `name` (`./recipes/` first); FileNotFoundError listing the available ones."""
    name = name.removesuffix(".yaml")
    for directory in recipe_dirs():
        path = directory / f"{name}.yaml"
        if path.is_file():
            return path
    names = available_recipes()
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise FileNotFoundError(
        f"recipe '{name}' not found{hint}: looked in {', '.join(str(d) for d in recipe_dirs())}; "
        f"available recipes: {', '.join(names) or 'none'}"
    )


def recipe_summary(name: str) -> str:
    """The first comment line of a recipe file (its one-line description)."""
    for line in find_recipe(name).read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return ""


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`override` on top of `base`: mappings merge key by key, everything else (lists too) is replaced."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _resolve_inherit(data: dict[str, Any], chain: tuple[str, ...], source: str) -> dict[str, Any]:
    parent = data.pop(INHERIT_KEY, None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ConfigError(f"inherit ({parent!r}) must be one recipe name, e.g. `inherit: tiny-dapo`", source=source)
    parent = parent.removesuffix(".yaml")
    if parent in chain:
        cycle = " -> ".join((*chain, parent))
        raise ConfigError(f"recipe inheritance cycle {cycle}: remove one of the `inherit:` lines", source=source)
    try:
        base = _load_recipe_data(parent, chain)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{source}: inherit: {exc}") from None
    return deep_merge(base, data)


def _load_recipe_data(name: str, chain: tuple[str, ...] = ()) -> dict[str, Any]:
    path = find_recipe(name)
    return _resolve_inherit(read_yaml(path), (*chain, name), str(path))


# ---------------- schema walking: valid keys, did-you-mean ----------------


def is_union(annotation: Any) -> bool:
    """``X | Y`` or ``Optional[X]``."""
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _model_class(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model class of a (possibly Optional) annotation, else None."""
    candidates = typing.get_args(annotation) if is_union(annotation) else (annotation,)
    for cand in candidates:
        if isinstance(cand, type) and issubclass(cand, BaseModel):
            return cand
    return None


def section_at(parts: Sequence[str | int], root: type[BaseModel] = DapoConfig) -> type[BaseModel] | None:
    """The config section (pydantic model) at the path ``parts`` below ``root`` (default: the whole schema), or
    None where it is a value."""
    model: type[BaseModel] | None = root
    for part in parts:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        model = _model_class(model.model_fields[part].annotation)
    return model


def _unknown_key(section: str, name: str, valid: Sequence[str]) -> str:
    full = f"{section}.{name}" if section else name
    if full in MOVED_KEYS:  # a key of an older schema: say where it went
        new = MOVED_KEYS[full]
        under = " in ".join(f"`{part}:`" for part in reversed(new.split(".")[:-1]))
        return f"{full} moved to {new}: use --set {new}=VALUE, or in YAML put `{name}:` under {under}"
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    hint = f"did you mean '{section + '.' if section else ''}{close[0]}'? " if close else ""
    where = section or "the top level"
    return f"unknown key '{full}': {hint}valid keys of {where}: {', '.join(valid)}"


def check_dotted_key(dotted: str) -> None:
    """Raise ConfigError unless `dotted` names a field of the schema (sections may be set as a whole)."""
    parts = dotted.split(".")
    model: type[BaseModel] | None = DapoConfig
    for i, part in enumerate(parts):
        section = ".".join(parts[:i])
        if model is None:
            raise ConfigError(f"'{dotted}': '{section}' is a value, not a section: set '{section}=...' instead")
        if part not in model.model_fields:
            raise ConfigError(_unknown_key(section, part, list(model.model_fields)))
        model = _model_class(model.model_fields[part].annotation)


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in the nested dict ``data``, creating the sections on the way."""
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    # A whole section given as a mapping (`--set 'data={seed: 1}'`) merges into the section rather than replace it.
    node[leaf] = (
        deep_merge(node[leaf], value) if isinstance(value, dict) and isinstance(node.get(leaf), dict) else value
    )


# ---------------- pydantic errors -> readable lines ----------------


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _interval(field: FieldInfo | None) -> str | None:
    """The range of a field bounded on both sides, e.g. ``[0, 1)`` for ``Field(ge=0, lt=1)``; else None."""
    low = high = None
    for bound in field.metadata if field is not None else ():
        for attr, text in (("gt", "({}"), ("ge", "[{}"), ("lt", "{})"), ("le", "{}]")):
            limit = getattr(bound, attr, None)
            if limit is None:
                continue
            if attr in ("gt", "ge"):
                low = text.format(limit)
            else:
                high = text.format(limit)
    return f"{low}, {high}" if low and high else None


def _format_error(err: Mapping[str, Any], root: type[BaseModel] = DapoConfig, prefix: Sequence[str] = ()) -> list[str]:
    """One pydantic error of a model ``root`` as readable lines; ``prefix``: where ``root`` sits in the schema (its
    dotted keys are named from there)."""
    loc = [*prefix, *(str(p) for p in err["loc"])]
    dotted, kind, ctx = ".".join(loc), err["type"], err.get("ctx") or {}
    value = _short(err.get("input"))
    parent = section_at(err["loc"][:-1], root)  # the section holding the key, when the key is a field
    if kind == "value_error":  # our consistency rules: already "key (value) rule: fix" lines
        return str(err["msg"]).removeprefix("Value error, ").splitlines()
    if kind == "extra_forbidden":
        valid = list(parent.model_fields) if parent else []
        fix = "" if dotted in MOVED_KEYS else "; remove or rename it"
        return [_unknown_key(".".join(loc[:-1]), loc[-1], valid) + fix]
    if kind == "missing":
        return [f"{dotted}: required key missing: add it (e.g. `{dotted}: ...`)"]
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        interval = _interval(parent.model_fields.get(loc[-1]) if parent else None)
        if interval:
            return [f"{dotted} ({value}) must be in {interval}: use a value in that range"]
        limit = next(iter(ctx.values()), "?")
        return [f"{dotted} ({value}) must be {bounds[kind]} {limit}: use a value in range"]
    if kind == "literal_error":
        return [f"{dotted} ({value}) must be one of {ctx.get('expected')}: pick one of them"]
    if kind in {"model_type", "model_attributes_type", "dict_type"}:
        return [f"{dotted} ({value}) must be a section (a mapping of keys): indent its keys under `{loc[-1]}:`"]
    msg = str(err["msg"])
    rule = "must be " + msg.removeprefix("Input should be ") if msg.startswith("Input should be ") else msg.lower()
    return [f"{dotted} ({value}) {rule.replace(':', ';')}: fix the value or its type"]


def _drop_empty_sections(data: dict[str, Any], model: type[BaseModel] = DapoConfig) -> dict[str, Any]:
    """A section written as `tracking:` (null) means "all defaults"."""
    out = {}
    for key, value in data.items():
        sub = _model_class(model.model_fields[key].annotation) if key in model.model_fields else None
        if sub is not None and value is None:
            continue
        out[key] = _drop_empty_sections(value, sub) if sub is not None and isinstance(value, dict) else value
    return out


def validate_section(model: type[M], data: Mapping[str, Any], where: str) -> M:
    """``model`` (a config section, or settings built on one) validated from ``data``; its problems become one
    `ConfigError` whose lines name each key from ``where``, the section's dotted place in the config
    (``validate_section(BaseModelStageConfig, {"steps": 0}, "base_model")``: ``base_model.steps (0) must be > 0``)."""
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        prefix = where.split(".") if where else []
        lines = [line for err in exc.errors() for line in _format_error(err, model, prefix)]
        raise ConfigError(lines) from None


def config_from_dict(data: Mapping[str, Any], source: str | None = None) -> DapoConfig:
    """Validate a raw mapping into a DapoConfig; problems become one `ConfigError`."""
    try:
        return DapoConfig.model_validate(_drop_empty_sections(dict(data)))
    except ValidationError as exc:
        lines = [line for err in exc.errors() for line in _format_error(err)]
        raise ConfigError(lines, source=source) from None


# ---------------- the loader ----------------


def load_config(
    config_path: str | Path | None = None,
    recipe: str | None = None,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> DapoConfig:
    """Resolve the config: YAML file or recipe -> environment -> `--set` overrides (see the module doc).

    Args:
        config_path: a YAML file; default `params.yaml` in the cwd (used when `recipe` is None).
        recipe: a recipe name in `recipes/` (mutually exclusive with `config_path`).
        overrides: `dotted.key=value` strings, applied in order; values are parsed as YAML.
        env: the environment to read (default `os.environ`); pass `{}` to ignore it.
    """
    if config_path is not None and recipe is not None:
        raise ConfigError(
            f"got both --config ({config_path}) and --recipe ({recipe}): pass one; "
            f"a config file can `inherit: {recipe}` to build on a recipe"
        )
    if recipe is not None:
        recipe = recipe.removesuffix(".yaml")
        source = str(find_recipe(recipe))
        data = _load_recipe_data(recipe)
        data["recipe"] = recipe
    else:
        path = Path(config_path if config_path is not None else DEFAULT_CONFIG)
        source = str(path)
        data = _resolve_inherit(read_yaml(path), (), source)
        data.setdefault("recipe", path.stem)

    environ = os.environ if env is None else env
    for var, dotted in ENV_OVERRIDES.items():
        if environ.get(var):
            logger.debug("%s from $%s", dotted, var)
            set_dotted(data, dotted, environ[var])

    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set '{item}' must look like dotted.key=value, e.g. --set trainer.lr=1e-5")
        check_dotted_key(key)
        set_dotted(data, key, parse_yaml_value(text))
    if overrides:
        source += f" (+ --set {' '.join(overrides)})"
    return config_from_dict(data, source=source)
