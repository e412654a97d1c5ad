"""One source of truth for configuration: typed settings models.

Every field is settable four ways, in this order of precedence: a CLI flag
(`--kv-cache-gib 2`), an environment variable with the `PDSERVE_` prefix
(`PDSERVE_KV_CACHE_GIB=2`), a key of a settings file given with `--config`
(`engine: {kv_cache_gib: 2}`, `services/config_file.py`), or the default here.
`add_arguments` derives the flags from the fields, so flags, env names, file keys and
docs cannot drift apart (the Helm chart and the configuration reference are checked
against these models by tests; `services/config_doc.py` writes the reference from them).

A field marked `json_schema_extra=ADVANCED` is an expert knob (timeouts,
staging sizes, keepalives, ...): `--help` lists it apart, under "advanced".
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource

from services.config_sections import section_of

S = TypeVar("S", bound=BaseSettings)

# Where the parsed `--config` file and the settings a command exposes live in the
# parsed arguments.
CONFIG_DEST = "config_file"
EXPOSED_DEST = "settings_exposed"
ADVANCED_TITLE = "advanced"
# The marker of an expert knob on a settings field (read, never modified).
ADVANCED: dict[str, Any] = {"advanced": True}
# String fields that hold a list: their flag may be repeated and take several values,
# joined with commas, and goes by these spellings too (vLLM's, for its users).
LIST_FLAGS: dict[str, tuple[str, ...]] = {"lora_modules": ("--lora",)}
# Fields that hold a list of entries (each a small mapping): each use of the flag adds
# one entry, written KEY=VALUE,KEY=VALUE; these spellings are taken too.
ENTRY_FLAGS: dict[str, tuple[str, ...]] = {"models": ("--add-model",)}


class _JoinValues(argparse.Action):
    """Each use of the flag adds its values to the comma-separated list so far."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        before = getattr(namespace, self.dest, None)
        items = [before] if isinstance(before, str) and before else []
        setattr(namespace, self.dest, ",".join([*items, *values]))


class _AddEntries(argparse.Action):
    """Each value is one more entry, KEY=VALUE,...: a mapping checked as its field's
    entries are (`entry`), so a wrong key or value is a usage error naming it."""

    entry: TypeAdapter[Any]  # set per field by `_entries_of`

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        entries = list(getattr(namespace, self.dest, None) or [])
        for value in values:
            entry = {}
            for part in str(value).split(","):
                key, sep, item = part.partition("=")
                if not sep or not key.strip():
                    raise argparse.ArgumentError(self, f"{part!r} in {value!r} is not "
                                                 "KEY=VALUE (entries: KEY=VALUE,KEY=VALUE)")
                entry[key.strip()] = item.strip()
            try:
                self.entry.validate_python(entry)
            except ValidationError as e:
                why = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
                                for err in e.errors())
                raise argparse.ArgumentError(self, f"{value!r}: {why}") from None
            entries.append(entry)
        setattr(namespace, self.dest, entries)


def _entries_of(entry: Any) -> type[argparse.Action]:
    """The action of a flag whose entries are each checked as `entry` (a type)."""
    return type("AddEntries", (_AddEntries,), {"entry": TypeAdapter(entry)})


@dataclass(frozen=True, slots=True)
class SettingsFile:
    """A parsed, checked settings file: each settings model's values, by field name."""

    path: str
    values: Mapping[type[BaseSettings], Mapping[str, Any]]

    def values_for(self, model: type[BaseSettings]) -> Mapping[str, Any]:
        return self.values.get(model, {})


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(model: type[BaseSettings], field: str) -> str:
    prefix = str(model.model_config.get("env_prefix", ""))
    return (prefix + field).upper()


def is_advanced(field: FieldInfo) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("advanced"))


def summary(model: type[BaseSettings]) -> str:
    """The first line of the model's docstring, without the env prefix note."""
    first = (model.__doc__ or "").strip().splitlines()[0] if model.__doc__ else ""
    return first.replace(" Env prefix PDSERVE_.", "").strip()


def _base_type(annotation: Any) -> Any:
    """`int | None` -> int; `Literal[...]` stays as is."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


def _group(parser: argparse.ArgumentParser, title: str,
           description: str | None = None) -> argparse._ArgumentGroup:
    """The parser's argument group titled `title`, made when missing."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title, description)


def _advanced_group(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    return _group(parser, ADVANCED_TITLE, "expert knobs a first deployment leaves at their "
                  "defaults (timeouts, staging sizes, keepalives, checksums, limits)")


def _advanced_last(parser: argparse.ArgumentParser) -> None:
    """List the advanced group after every section's own, however many models follow."""
    for group in parser._action_groups:
        if group.title == ADVANCED_TITLE:
            parser._action_groups.remove(group)
            parser._action_groups.append(group)
            return


def _expose(parser: argparse.ArgumentParser, model: type[BaseSettings],
            fields: list[str]) -> None:
    """Record that `parser`'s command takes these fields of `model` (`config show`)."""
    exposed: dict[type[BaseSettings], tuple[str, ...]] = dict(
        parser.get_default(EXPOSED_DEST) or {})
    exposed[model] = (*exposed.get(model, ()), *fields)
    parser.set_defaults(**{EXPOSED_DEST: exposed})


def add_arguments(parser: argparse.ArgumentParser, model: type[BaseSettings],
                  exclude: tuple[str, ...] = (), only: tuple[str, ...] = ()) -> None:
    """Add one flag per settings field (but `exclude`; only `only` when given), grouped
    in `--help` by the model's section of the settings file, expert knobs apart. Flags
    default to "not given" so that only what the user typed overrides the environment."""
    section = section_of(model)
    about = summary(model).rstrip(".")
    group = (_group(parser, section, f"{about} (settings file section `{section}:`)")
             if section else _group(parser, model.__name__, about))
    names = [n for n in model.model_fields if n not in exclude and (not only or n in only)]
    _expose(parser, model, names)
    for name in names:
        field = model.model_fields[name]
        base = _base_type(field.annotation)
        default = field.get_default(call_default_factory=True)
        key = f"file {section}.{name}; " if section else ""
        help_text = (f"{field.description or ''} [env {env_name(model, name)}; {key}"
                     f"default {default!r}]")
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        target = _advanced_group(parser) if is_advanced(field) else group
        if base is bool:
            target.add_argument(flag_name(name), action=argparse.BooleanOptionalAction,
                                **kwargs)
            continue
        if typing.get_origin(base) is list:
            target.add_argument(*ENTRY_FLAGS.get(name, ()), flag_name(name),
                                metavar="KEY=VALUE,...", nargs="+",
                                action=_entries_of(typing.get_args(base)[0]),
                                **kwargs)
            continue
        if name in LIST_FLAGS:
            target.add_argument(*LIST_FLAGS[name], flag_name(name), metavar="NAME=PATH",
                                nargs="+", action=_JoinValues, **kwargs)
            continue
        if typing.get_origin(base) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(base))
            kwargs["type"] = type(kwargs["choices"][0])
        elif base in (int, float, str):
            kwargs["type"] = base
        target.add_argument(flag_name(name), metavar=name.upper(), **kwargs)
    _advanced_last(parser)


def exposed_settings(args: argparse.Namespace) -> dict[type[BaseSettings], tuple[str, ...]]:
    """The settings models (and their fields) the parsed command takes flags for."""
    return dict(getattr(args, EXPOSED_DEST, None) or {})


def from_arguments(model: type[S], args: argparse.Namespace) -> S:
    """Build settings from the flags that were given, over the environment, over the
    `--config` file's section of this model, over the defaults."""
    given = {k: v for k, v in vars(args).items() if k in model.model_fields}
    file: SettingsFile | None = getattr(args, CONFIG_DEST, None)
    if file is None:
        return model(**given)
    # The file's values go in below what the environment sets: the model's own sources
    # would rank any keyword argument above its environment.
    env = EnvSettingsSource(model)()
    return model(**{**file.values_for(model), **env, **given})
