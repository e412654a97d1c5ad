"""Settings files: `pdserve up|serve|router|prefill|decode --config FILE.yaml`.

A YAML mapping of sections (`services/config_sections.py`), each a mapping of one
settings model's field names to values:

    engine:
      max_model_len: 4096
    router:
      policy: round_robin

The file ranks below flags and `PDSERVE_*` variables and above the defaults
(`services/settings.py`'s `from_arguments`). It is checked whole when read: an unknown
section or key, or a value its field refuses, is an error that names the file and the
key's path. `pdserve config show` prints a command's effective settings in this shape,
secrets masked, so its output is a settings file again.
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import yaml  # type: ignore[import-untyped]
from pydantic import BaseModel, SecretStr, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from services.config_sections import section_models, section_of
from services.security.redaction import MASK, redact_url
from services.settings import CONFIG_DEST, SettingsFile, exposed_settings, from_arguments

# Fields whose value is itself a credential (their *_file siblings are paths: shown).
SECRET_NAME = re.compile(r"(secret|password|api_keys?|token)$")


class ConfigFileError(ValueError):
    """A settings file that cannot be read or holds something pdserve refuses."""


def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _field_adapter(field: FieldInfo) -> TypeAdapter[Any]:
    """Validates one value as the field does (its type and constraints)."""
    form: Any = field.annotation
    if field.metadata:
        form = Annotated[(form, *field.metadata)]
    return TypeAdapter(form)


def _section_problems(name: str, section: str, model: type[BaseSettings],
                      values: Any) -> list[str]:
    if values is None:
        return []
    if not isinstance(values, Mapping):
        return [f"{name}: {section} must be a mapping of setting names to values, not "
                f"{type(values).__name__}"]
    problems = []
    fields = list(model.model_fields)
    for key, value in values.items():
        if key not in model.model_fields:
            problems.append(f"{name}: {section}.{key} is not a setting"
                            f"{_suggest(str(key), fields)}")
            continue
        try:
            _field_adapter(model.model_fields[key]).validate_python(value)
        except ValidationError as e:
            why = "; ".join(err["msg"] for err in e.errors())
            problems.append(f"{name}: {section}.{key}: {why} (got {value!r})")
    return problems


def parse_config(text: str, name: str) -> SettingsFile:
    """The settings in `text` (a file's contents; `name` is how errors call it)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigFileError(f"{name}: not YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigFileError(f"{name}: must be a mapping of sections "
                              f"({', '.join(section_models())}), not {type(data).__name__}")
    models = section_models()
    problems = []
    values: dict[type[BaseSettings], Mapping[str, Any]] = {}
    for section, section_values in data.items():
        model = models.get(section)
        if model is None:
            hint = _suggest(str(section), list(models))
            problems.append(f"{name}: {section} is not a section{hint}; sections: "
                            f"{', '.join(models)}")
            continue
        found = _section_problems(name, section, model, section_values)
        problems += found
        if not found:
            values[model] = dict(section_values or {})
    if problems:
        raise ConfigFileError("\n".join(problems))
    return SettingsFile(name, values)


def load_config(path: str) -> SettingsFile:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigFileError(f"{path}: cannot read: {e.strerror or e}") from None
    return parse_config(text, path)


def config_argument(path: str) -> SettingsFile:
    """`--config`'s argparse type: the file, read and checked while parsing the flags."""
    try:
        return load_config(path)
    except ConfigFileError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """`--config`, and a usage line that stays short however many flags follow."""
    parser.usage = "%(prog)s [-h] [--config FILE.yaml] [FLAG ...]"
    parser.add_argument(
        "--config", dest=CONFIG_DEST, type=config_argument, default=None,
        metavar="FILE.yaml", help="settings file: one section per settings group below "
        "(engine:, server:, ...), keyed by setting name; flags and PDSERVE_* variables win "
        "over it (docs/configuration.md)")


# -- config show ----------------------------------------------------------------------
def mask(name: str, value: Any) -> Any:
    """`value` as `config show` prints it: credentials masked, paths kept."""
    if isinstance(value, SecretStr):
        return MASK if value.get_secret_value() else ""
    if isinstance(value, BaseModel):  # an entry of a list setting (launcher.models)
        value = value.model_dump()
    if isinstance(value, dict):
        return {k: mask(k, v) for k, v in value.items()}
    if isinstance(value, list):
        return [mask(name, v) for v in value]
    if not isinstance(value, str) or not value:
        return value
    if SECRET_NAME.search(name):
        return MASK
    return redact_url(value)


def effective_settings(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Section -> {field: value} of the settings the parsed command takes, as it
    resolves them (flag > env > file > default), secrets masked."""
    shown: dict[str, dict[str, Any]] = {}
    for model, fields in exposed_settings(args).items():
        section = section_of(model)
        if section is None:
            continue
        settings = from_arguments(model, args)
        shown.setdefault(section, {}).update(
            {name: mask(name, getattr(settings, name)) for name in fields})
    order = list(section_models())
    return {s: shown[s] for s in sorted(shown, key=order.index)}


def show(args: argparse.Namespace, command: str) -> str:
    """`pdserve config show --for <command> ...`: the effective settings as YAML."""
    header = (f"# pdserve {command}: effective settings (flag > PDSERVE_* variable > "
              "--config file > default); secrets masked\n")
    return header + yaml.safe_dump(effective_settings(args), sort_keys=False,
                                   default_flow_style=False)
