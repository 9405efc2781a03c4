"""`dapo <stage>` built from the stage's parameters (``flows/stage_params.py``): one option per ``Param``.

The command's options, their types, defaults and help are the ones the stage's Prefect deployment shows in its
form; the command collects them into ``StageValues`` and hands them to ``handler``, which runs the stage (through
``flows/stages.py``) and prints what the user needs. A user error (``stages.user_errors``) prints one red line and
exits with status 2, before or during the run.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import typer

from flows.cli.common import fail
from flows.stage_params import Param, StageSpec, StageValues, stage_values


def _cli_type(param: Param) -> Any:
    """The annotation Typer parses the option as (a ``Literal`` becomes a choice); a split list is parsed here."""
    return list[str] | None if param.split else param.type


def _split(param: Param, items: Sequence[str] | None) -> list[Any] | None:
    """``--rungs a,b --rungs c`` -> [a, b, c], converted to the list's item type; an empty list -> None."""
    if not items:
        return None
    (list_type,) = [a for a in typing.get_args(param.type) if typing.get_origin(a) is list] or [param.type]
    (item_type,) = typing.get_args(list_type)
    flag = param.cli_flags()[0]
    parts = [part.strip() for item in items for part in item.split(",") if part.strip()]
    try:
        return [item_type(part) for part in parts]
    except ValueError:
        fail(f"{flag} {','.join(items)!r}: each comma-separated value must be a {item_type.__name__}")


def _option(param: Param) -> inspect.Parameter:
    annotation = _cli_type(param)
    default = param.default
    if param.split and default is not None:
        default = list(default)
    option = typer.Option(*param.cli_flags(), help=param.help, show_default=default not in (None, []))
    return inspect.Parameter(
        param.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[annotation, option]
    )


def stage_command(
    app: typer.Typer, spec: StageSpec, handler: Callable[[StageValues], None], *, doc: str | None = None
) -> None:
    """Register ``dapo <spec.name>``: options from ``spec.params`` (``form``-only ones too), body ``handler``."""
    params = [_option(p) for p in spec.params]
    split = {p.name: p for p in spec.params if p.split}

    def command(**given: Any) -> None:
        for name, param in split.items():
            given[name] = _split(param, given[name]) or (None if param.default is None else list(param.default))
        given = {k: (list(v) if isinstance(v, tuple) else v) for k, v in given.items()}
        handler(stage_values(spec, given))

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__name__ = spec.name.replace("-", "_")
    command.__doc__ = doc or spec.summary
    app.command(spec.name)(command)
