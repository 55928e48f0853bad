"""How a setting is written: once, in the frozen dataclass of its config section.

A section field is ``name: type = setting(default, "help", range="[1, inf)")`` (or
``choices=NAMES`` for an enumerated value, ``fingerprint=False`` for a setting that does not
change the stage's result). From that one line come:

* the check (:class:`Checked`: every instance checks each field's range / choices in
  ``__post_init__``, whether it was built from YAML or in Python; a cross-field rule of a
  section is its ``_check`` method),
* the stage fingerprint (:func:`fingerprint_fields`: every field not opted out),
* the ``infoform config --list`` line (:func:`describe`).

A runtime class that needs a section's settings subclasses the section (it adds only what
the run resolves); a field taken from another section is ``same_as(Section, "name")``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterator

__all__ = ["SettingError", "Interval", "setting", "same_as", "Checked", "check_settings", "fingerprint_fields",
           "describe", "section_types", "to_dict"]


class SettingError(ValueError):
    """A field's value outside its range or choices: ``key`` names the field; the message is
    ``template`` with ``{key}`` replaced (:meth:`keyed` puts the section's dotted prefix on it)."""

    def __init__(self, key: str, template: str):
        super().__init__(template.replace("{key}", key))
        self.key, self.template = key, template

    def keyed(self, prefix: str) -> str:
        return self.template.replace("{key}", prefix + self.key)


@dataclass(frozen=True)
class Interval:
    """A numeric range written as in mathematics: ``"[0, inf)"``, ``"(0, 1]"``."""

    low: float
    high: float
    low_open: bool
    high_open: bool

    @classmethod
    def parse(cls, text: str) -> "Interval":
        text = text.strip()
        if text[0] not in "[(" or text[-1] not in "])" or text.count(",") != 1:
            raise ValueError(f"range {text!r} is not like '[0, inf)'")
        lo, hi = (float(v) for v in text[1:-1].split(","))
        return cls(lo, hi, text[0] == "(", text[-1] == ")")

    def __contains__(self, v: float) -> bool:
        above = v > self.low if self.low_open else v >= self.low
        below = v < self.high if self.high_open else v <= self.high
        return bool(above and below)

    def __str__(self) -> str:
        if self.low == -math.inf and self.high == math.inf:
            return "any finite number"
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


def setting(default: Any = dataclasses.MISSING, help: str = "", *, range: str | None = None,
            choices: Any = None, item: str | None = None, fingerprint: bool = True,
            factory: Any = dataclasses.MISSING) -> Any:
    """A config field: its default (or ``factory``), help text, valid ``range`` (an
    :class:`Interval` string, for numbers and for each number of a tuple) or ``choices`` (any
    iterable of names, for a string and for each string of a tuple; ``item`` names one entry
    of a list in the message), and whether it enters the stage fingerprint."""
    meta = {"help": help, "range": None if range is None else Interval.parse(range),
            "choices": None if choices is None else tuple(choices), "item": item or "value",
            "fingerprint": fingerprint}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def same_as(section: type, name: str, **meta: Any) -> Any:
    """The field ``name`` of ``section`` (default, range, help; ``meta`` replaces entries), for
    a runtime class that takes one setting of another section (its default is not written again)."""
    f = section.__dataclass_fields__[name]
    metadata = {**f.metadata, **meta}
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata=metadata)
    return dataclasses.field(default=f.default, metadata=metadata)


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base_types(tp: Any) -> set[Any]:
    """The plain types an annotation admits (``int | None`` -> {int, NoneType})."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return set().union(*(_base_types(a) for a in typing.get_args(tp)))
    return {typing.get_origin(tp) or tp}


def _element_types(tp: Any) -> set[Any]:
    """The plain types of a tuple annotation's elements (``tuple[int, ...]`` -> {int})."""
    out: set[Any] = set()
    for a in (tp, *typing.get_args(tp)):
        if typing.get_origin(a) is tuple:
            out |= set().union(*(_base_types(e) for e in typing.get_args(a) if e is not Ellipsis))
    return out


def _items(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _check_number(name: str, v: Any, meta: Any, integral: bool) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise SettingError(name, f"{{key}} must be a number, got {v!r}")
    if integral and not float(v).is_integer():
        raise SettingError(name, f"{{key}} must be an integer, got {v!r}")
    if meta["range"] is not None and (math.isnan(v) or v not in meta["range"]):
        raise SettingError(name, f"{{key}} must be {'an int ' if integral else ''}{meta['range']}, got {v!r}")


def check_settings(obj: Any) -> None:
    """Every field of dataclass ``obj`` with a range or choices, checked (``None`` passes where
    the annotation admits it); the first bad one raises :class:`SettingError`."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        meta, value = f.metadata, getattr(obj, f.name)
        if not meta or (meta.get("range") is None and meta.get("choices") is None):
            continue
        if value is None and type(None) in _base_types(hints[f.name]):
            continue
        if meta["choices"] is not None:
            for v in _items(value):
                if not (isinstance(v, str) and v in meta["choices"]):
                    valid = ", ".join(meta["choices"])
                    raise SettingError(f.name, f"{{key}}: unknown {meta['item']} {v!r}; valid: {valid}"
                                       if isinstance(value, (tuple, list)) else f"unknown {{key}} {v!r}; valid: {valid}")
        else:
            numbers_kinds = _base_types(hints[f.name]) | _element_types(hints[f.name])
            integral = int in numbers_kinds and float not in numbers_kinds
            for v in _items(value):
                _check_number(f.name, v, meta, integral)


class Checked:
    """Base of the config sections: ``__post_init__`` checks every field's range and choices
    (:func:`check_settings`), then each class's own ``_check`` (cross-field rules), base
    classes first."""

    def __post_init__(self) -> None:
        check_settings(self)
        for cls in reversed(type(self).__mro__):
            own = cls.__dict__.get("_check")
            if own is not None:
                own(self)


def to_dict(obj: Any) -> Any:
    """JSON/YAML-able nested dict of a config tree."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_dict(v) for v in obj]
    return obj


def fingerprint_fields(obj: Any, section: type | None = None) -> dict[str, Any]:
    """The fields of ``obj`` (only those of ``section``, when given) that shape its stage's
    result (all but ``fingerprint=False``), as JSON-able values (nested sections recursively)."""
    return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(section or obj)
            if f.metadata.get("fingerprint", True)}


def section_types(tp: Any) -> list[type]:
    """The config dataclasses an annotation holds (``ShiftSpec | None``, ``tuple[MethodRange, ...]``)."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return [tp]
    return [sub for a in typing.get_args(tp) for sub in section_types(a)]


def describe(cls: type, prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """``(key, default, valid, help)`` for every key under section ``cls`` (nested sections
    expanded after their own line)."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        meta = f.metadata or {}
        kinds = _base_types(hints[f.name])
        if meta.get("choices") is not None:
            valid = "one of " + ", ".join(meta["choices"])
        elif meta.get("range") is not None:
            valid = str(meta["range"])
        else:
            valid = " | ".join(sorted(getattr(t, "__name__", str(t)) for t in kinds - {type(None)}))
        if type(None) in kinds:
            valid += " or null"
        yield key, _show(default), valid, meta.get("help", "")
        for sub in section_types(hints[f.name]):
            yield from describe(sub, f"{key}[]." if tuple in kinds else f"{key}.")


def _show(value: Any) -> str:
    if dataclasses.is_dataclass(value):
        return "(section)"
    if value is dataclasses.MISSING:
        return "(required)"
    if value == "":
        return '""'
    v = to_dict(value)
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
