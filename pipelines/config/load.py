"""Loading the config tree: YAML presets, ``key.path=value`` overrides, type checks.

A preset is a YAML file in ``configs/`` whose keys mirror :class:`~pipelines.config.schema.RunConfig`.
CLI overrides are ``key.path=value`` strings (``--set curvature.num_workers=4``); values are
parsed as YAML scalars/lists and checked against the field's type. An unknown key is one
:class:`~pipelines.config.schema.ConfigError` line naming the closest valid key.

:func:`derive` builds a stage's runtime settings from the tree mechanically: every field the
runtime class shares with a config section is copied, so no field list is written twice.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml

from pipelines.config.schema import ConfigError, RunConfig
from pipelines.config.settings import SettingError, to_dict

__all__ = ["PRESETS_DIR", "list_presets", "load_config", "from_dict", "to_dict", "apply_overrides", "derive"]

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's when built with it: same results, faster
PRESETS_DIR = Path(__file__).resolve().parents[2] / "configs"


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert ``value`` to annotation ``tp`` (the subset used in this module)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: cannot be null")
    if origin is tuple:
        if value is None and args and hasattr(args[0], "from_text"):  # data.ood: null, as before the list
            return ()
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}: expected a mapping with string keys, got {value!r}")
        return dict(value)
    if _is_dataclass_type(tp):
        return _section(value, tp, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return str(value)
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp!r}")  # pragma: no cover


def _section(value: Any, tp: type, key: str) -> Any:
    """A config section from a mapping (or, where the section reads text, e.g. an OOD set written
    ``NAME=URI``, from a string)."""
    if isinstance(value, tp):
        return value
    if isinstance(value, str) and hasattr(tp, "from_text"):
        try:
            return tp.from_text(value)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{key}: {e}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping, got {value!r}")
    return from_dict(tp, value, prefix=f"{key}.")


def from_dict(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested mapping; unknown keys raise ConfigError."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), names, n=1, cutoff=0.5)
        hint = f"; did you mean {prefix}{close[0]}?" if close else ""
        raise ConfigError(f"unknown key {prefix}{unknown[0]}{hint} (valid keys here: {', '.join(names)})")
    kwargs = {k: _coerce(v, hints[k], f"{prefix}{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except SettingError as e:  # a field out of its range or choices
        raise ConfigError(e.keyed(prefix)) from None
    except (ValueError, TypeError) as e:  # a section's own rule: name the field it starts with, else the section
        msg = str(e)
        first = re.match(r"\w*", msg).group()
        if first in names:
            raise ConfigError(f"{prefix}{msg}") from None
        raise ConfigError(f"{prefix.rstrip('.')}: {msg}" if prefix else msg) from None


def _set_path(tree: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = {}
            node[p] = nxt
        if not isinstance(nxt, dict):
            raise ConfigError(f"cannot set {path}: {p} is not a section")
        node = nxt
    node[parts[-1]] = value


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    """Apply ``key.path=value`` overrides (values parsed as YAML) to a nested dict."""
    out = copy.deepcopy(tree)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. curvature.num_workers=4)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        _set_path(out, key, value)
    return out


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def _read_preset(name_or_path: str) -> dict:
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.exists()):
        path = PRESETS_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise ConfigError(f"unknown preset {name_or_path!r}; valid: {', '.join(list_presets())} (or a path to a .yaml file)")
    try:
        data = yaml.load(path.read_text(), Loader=_LOADER)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"preset {path.name} does not parse{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"preset {path.name} must be a mapping at the top level")
    data.setdefault("preset", path.stem)
    return data


def load_config(preset: str, overrides: list[str] | None = None) -> RunConfig:
    """Preset + ``key=value`` overrides -> validated, frozen :class:`RunConfig`."""
    tree = apply_overrides(_read_preset(preset), list(overrides or []))
    return from_dict(RunConfig, tree).validate()


def preset_settings(preset: str) -> RunConfig:
    """A preset's settings, not validated (no ``data.root`` needed): where a command that runs no
    job (``infoform sizes``) reads the default the job would use, so that default lives once."""
    return from_dict(RunConfig, _read_preset(preset))


def _admits_none(tp: Any) -> bool:
    return tp is type(None) or (typing.get_origin(tp) in (typing.Union, types.UnionType)
                                and type(None) in typing.get_args(tp))


def derive(cls: type, *sections: Any, **overrides: Any) -> Any:
    """``cls(**kw)`` where ``kw`` holds every field of ``cls`` that one of the config
    ``sections`` (dataclasses of this tree) also has, later sections and then ``overrides``
    winning. A section's ``None`` is left out where ``cls``'s field does not admit ``None``
    (the section's "use the default": e.g. ``data.mean: null``), so the runtime default applies."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    kw: dict[str, Any] = {}
    for sec in sections:
        for f in dataclasses.fields(sec):
            if f.name not in names:
                continue
            v = getattr(sec, f.name)
            if v is None and not _admits_none(hints[f.name]):
                continue
            kw[f.name] = v
    kw.update(overrides)
    return cls(**kw)
