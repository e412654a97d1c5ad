"""The dict form of the KV leg's typed records (`KVSettings`, `SendParams`, `RecvParams`,
`LoadReport`): each crosses a boundary where only plain dicts travel (vLLM's
`kv_connector_extra_config`, `kv_transfer_params` and the final output's
`kv_transfer_params`), and is read back strictly, so a misspelled or missing key is an
error naming the key and the record, never a silent default."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple, Self, get_type_hints


class _Field(NamedTuple):
    name: str
    type: Any  # the resolved annotation
    required: bool


_FIELDS: dict[type, tuple[_Field, ...]] = {}  # per record class, resolved once


def _fields(cls: type[Contract]) -> tuple[_Field, ...]:
    fields = _FIELDS.get(cls)
    if fields is None:
        hints = get_type_hints(cls)
        fields = _FIELDS[cls] = tuple(
            _Field(f.name, hints[f.name],
                   f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls) if f.init)
    return fields


def _checked(record: str, key: str, kind: Any, value: Any) -> Any:
    """`value` as the field's type wants it (an int where a float is wanted becomes one);
    ValueError for a scalar of the wrong type. Other annotations are not checked."""
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(kind, True)
    if not ok:
        raise ValueError(f"{record}: key {key!r} must be {kind.__name__}, got "
                         f"{type(value).__name__} {value!r}")
    return float(value) if kind is float else value


class Contract:
    """Mixin of a frozen dataclass whose fields are plain values: `to_dict()` and a strict
    `from_dict()` (unknown keys, missing required keys and scalars of the wrong type are
    refused with a ValueError that names the record and the key)."""

    __slots__ = ()
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in _fields(type(self))}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        record, fields = cls.__name__, _fields(cls)
        known = {f.name for f in fields}
        for key in data:
            if key not in known:
                raise ValueError(f"{record}: unknown key {key!r} (known: "
                                 f"{', '.join(f.name for f in fields)})")
        for f in fields:
            if f.required and f.name not in data:
                raise ValueError(f"{record}: missing key {f.name!r}")
        return cls(**{f.name: _checked(record, f.name, f.type, data[f.name])
                      for f in fields if f.name in data})
