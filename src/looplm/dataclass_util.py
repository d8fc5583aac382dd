"""Typed, validated configuration dataclasses.

Every config in looplm is a plain ``@dataclass``. This module turns nested dicts (from YAML or
``--set key=value`` overrides) into those dataclasses and reports *all* problems at once:

* unknown or misspelled keys, with close-match suggestions (``difflib``),
* values of the wrong type,
* the semantic checks of each dataclass (its ``validate()`` method returns a list of messages).

One ``ConfigError`` (a ``ValueError``) names every bad field, so a user fixes a config in one go.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration is invalid. ``errors`` lists one message per bad field."""

    def __init__(self, errors: list[str], what: str = "config"):
        self.errors = list(errors)
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"invalid {what} ({len(self.errors)} problem(s)):\n{lines}")


def _suggest(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=3, cutoff=0.6)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


def _is_optional(tp) -> tuple[bool, Any]:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) < len(get_args(tp)):
            return True, args[0] if len(args) == 1 else Union[tuple(args)]
    return False, tp


def _coerce(value: Any, tp, path: str, errors: list[str]):
    """Convert ``value`` to type ``tp`` (recursively for dataclasses / lists / dicts)."""
    optional, inner = _is_optional(tp)
    if value is None:
        if optional or tp is Any:
            return None
        errors.append(f"{path}: must not be null")
        return None
    tp = inner
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(value) and isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
            return None
        return _build(tp, value, path, errors)
    origin = get_origin(tp)
    if origin in (list, tuple, typing.Sequence):
        if not isinstance(value, (list, tuple)):
            errors.append(f"{path}: expected a list, got {value!r}")
            return None
        args = get_args(tp)
        elem = args[0] if args else Any
        out = [_coerce(v, elem, f"{path}[{i}]", errors) for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {value!r}")
            return None
        return dict(value)
    if origin is typing.Literal:
        if value not in get_args(tp):
            errors.append(f"{path}: {value!r} is not one of {list(get_args(tp))}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        errors.append(f"{path}: expected true/false, got {value!r}")
        return None
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            errors.append(f"{path}: expected an integer, got {value!r}")
            return None
        try:
            f = float(value)
            if f != int(f):
                raise ValueError
            return int(f)
        except (ValueError, OverflowError):
            errors.append(f"{path}: expected an integer, got {value!r}")
            return None
    if tp is float:
        if isinstance(value, bool):
            errors.append(f"{path}: expected a number, got {value!r}")
            return None
        try:
            return float(value)
        except (TypeError, ValueError):
            errors.append(f"{path}: expected a number, got {value!r}")
            return None
    if tp is str:
        if not isinstance(value, str):
            errors.append(f"{path}: expected a string, got {value!r}")
            return None
        return value
    return value


def _build(cls: type[T], data: dict, path: str, errors: list[str]) -> T | None:
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            errors.append(f"{where}: unknown key{_suggest(key, list(fields))}")
            continue
        kwargs[key] = _coerce(value, hints[key], where, errors)
    n_before = len(errors)
    if n_before:
        # still run the semantic checks on what we could build, so every problem is reported
        kwargs = {k: v for k, v in kwargs.items() if v is not None or _is_optional(hints[k])[0]}
    try:
        obj = cls.__new__(cls)
        for f in dataclasses.fields(cls):
            if f.name in kwargs:
                val = kwargs[f.name]
            elif f.default is not dataclasses.MISSING:
                val = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                val = f.default_factory()  # type: ignore[misc]
            else:
                errors.append(f"{path + '.' if path else ''}{f.name}: required but missing")
                return None
            object.__setattr__(obj, f.name, val)
        if hasattr(obj, "validate"):
            for msg in obj.validate():
                errors.append(f"{path + '.' if path else ''}{msg}")
        if hasattr(obj, "__post_build__"):
            obj.__post_build__()
    except Exception as e:  # a validate() that trips over a bad value already reported
        if len(errors) == n_before:
            errors.append(f"{path or cls.__name__}: {e}")
        return None
    return obj


def from_dict(cls: type[T], data: dict | None, what: str | None = None) -> T:
    """Build dataclass ``cls`` from a nested dict, raising one ``ConfigError`` listing every problem."""
    errors: list[str] = []
    obj = _build(cls, dict(data or {}), "", errors)
    errors = list(dict.fromkeys(errors))  # a nested config may be checked by itself and by its parent
    if errors or obj is None:
        raise ConfigError(errors or ["could not build config"], what or cls.__name__)
    return obj


def to_dict(obj) -> dict:
    """Inverse of ``from_dict``: a plain nested dict (lists, not tuples) that YAML/JSON can hold."""

    def conv(v):
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return conv(obj)


def parse_value(text: str):
    """Parse the right-hand side of ``--set key=value`` with YAML rules (numbers, bools, lists)."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[str] | dict) -> dict:
    """Apply ``a.b.c=value`` overrides to a nested dict (returns a new dict)."""
    import copy

    out = copy.deepcopy(data)
    items = overrides.items() if isinstance(overrides, dict) else (split_override(o) for o in overrides)
    for key, value in items:
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[parts[-1]] = parse_value(value) if isinstance(value, str) and not isinstance(overrides, dict) else value
    return out


def split_override(o: str) -> tuple[str, str]:
    """``"a.b=value"`` -> ``("a.b", "value")`` (the value still unparsed)."""
    if "=" not in o:
        raise ConfigError([f"override {o!r} is not of the form key=value"], "override")
    k, v = o.split("=", 1)
    return k.strip(), v




def read_yaml_file(path, what: str) -> dict:
    """The top-level mapping of a YAML config file.

    Raises one ``ConfigError`` (titled ``what``) when the file is not valid YAML, is empty or holds
    only comments (which would silently mean "all defaults"), or is not a mapping.
    """
    from pathlib import Path

    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError([f"{path}: not valid YAML: {e}"], what) from e
    if data is None or data == {}:
        raise ConfigError(
            [f"{path}: the file is empty or holds only comments; write the settings into it (an empty config "
             "would silently mean all defaults)"],
            what,
        )
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a mapping of settings, got a {type(data).__name__}"], what)
    return data


def refuse_empty_yaml(spec, what: str) -> None:
    """If ``spec`` names an existing ``.yaml`` / ``.yml`` file, check it with :func:`read_yaml_file`
    (presets and dicts pass untouched)."""
    from pathlib import Path

    if isinstance(spec, (str, Path)) and str(spec).endswith((".yaml", ".yml")) and Path(spec).is_file():
        read_yaml_file(spec, what)
