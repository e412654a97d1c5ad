"""One source of truth for configuration: typed settings models.

Every field is settable three ways, in this order of precedence: a CLI flag
(`--kv-cache-gib 2`), an environment variable with the `PDSERVE_` prefix
(`PDSERVE_KV_CACHE_GIB=2`), or the default here. `add_arguments` derives the flags from
the fields, so flags, env names and docs cannot drift apart (the Helm chart and the
README's configuration table are checked against these models by tests;
`services/config_doc.py` writes the reference from them).
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, TypeVar

from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(model: type[BaseSettings], field: str) -> str:
    prefix = str(model.model_config.get("env_prefix", ""))
    return (prefix + field).upper()


def _base_type(annotation: Any) -> Any:
    """`int | None` -> int; `Literal[...]` stays as is."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


def add_arguments(parser: argparse.ArgumentParser, model: type[BaseSettings],
                  exclude: tuple[str, ...] = (), only: tuple[str, ...] = ()) -> None:
    """Add one flag per settings field (but `exclude`; only `only` when given). Flags
    default to "not given" so that only what the user typed overrides the environment."""
    group = parser.add_argument_group(f"{model.__name__} (env prefix PDSERVE_)")
    for name, field in model.model_fields.items():
        if name in exclude or (only and name not in only):
            continue
        base = _base_type(field.annotation)
        default = field.get_default(call_default_factory=True)
        help_text = f"{field.description or ''} [env {env_name(model, name)}; default {default!r}]"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if base is bool:
            group.add_argument(
                flag_name(name), action=argparse.BooleanOptionalAction, **kwargs
            )
            continue
        if typing.get_origin(base) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(base))
            kwargs["type"] = type(kwargs["choices"][0])
        elif base in (int, float, str):
            kwargs["type"] = base
        group.add_argument(flag_name(name), metavar=name.upper(), **kwargs)


def from_arguments(model: type[S], args: argparse.Namespace) -> S:
    """Build settings from env + defaults, overridden by the flags that were given."""
    given = {k: v for k, v in vars(args).items() if k in model.model_fields}
    return model(**given)
