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
import math
import types
import typing
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration is invalid. ``errors`` lists one message per bad field."""

    def __init__(self, errors: list[str], what: str = "config"):
        self.errors = [_bounded(str(e)) for e in errors]  # a message quoting a huge value stays readable
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"invalid {what} ({len(self.errors)} problem(s)):\n{lines}")


def _bounded(message: str, limit: int = 600) -> str:
    """``message`` cut in the middle to at most about ``limit`` characters (its start names the field,
    its end usually says what to do)."""
    if len(message) <= limit:
        return message
    keep = limit // 2 - 20
    return f"{message[:keep]} ... [{len(message) - 2 * keep:,} characters left out] ... {message[-keep:]}"


def brief(value: Any, limit: int = 120) -> str:
    """A bounded ``repr`` of ``value`` for error messages: nested containers and long strings are cut
    (``reprlib``), so a huge value (e.g. a YAML alias bomb) never becomes a huge message."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 3, 6, 6, 4, 6
    r.maxstring, r.maxother, r.maxlong = 60, 60, 40
    text = r.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
            errors.append(
                f"{path}: expected a mapping for {tp.__name__}, got {type(value).__name__} {brief(value, 60)}"
            )
            return None
        return _build(tp, value, path, errors)
    origin = get_origin(tp)
    if origin in (list, tuple, typing.Sequence):
        if not isinstance(value, (list, tuple)):
            errors.append(f"{path}: expected a list, got {brief(value)}")
            return None
        args = get_args(tp)
        elem = args[0] if args else Any
        out = [_coerce(v, elem, f"{path}[{i}]", errors) for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {brief(value)}")
            return None
        return dict(value)
    if origin is typing.Literal:
        if value not in get_args(tp):
            errors.append(f"{path}: {brief(value)} is not one of {list(get_args(tp))}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        errors.append(f"{path}: expected true/false, got {brief(value)}")
        return None
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            errors.append(f"{path}: expected an integer, got {brief(value)}")
            return None
        try:
            f = float(value)
            if f != int(f):
                raise ValueError
            return int(f)
        except (ValueError, OverflowError):
            errors.append(f"{path}: expected an integer, got {brief(value)}")
            return None
    if tp is float:
        if isinstance(value, bool):
            errors.append(f"{path}: expected a number, got {brief(value)}")
            return None
        try:
            f = float(value)
        except (TypeError, ValueError):
            errors.append(f"{path}: expected a number, got {brief(value)}")
            return None
        if math.isnan(f):  # NaN compares false with every bound, so it would pass any range check
            errors.append(f"{path}: got NaN (not a number); give a number")
            return None
        return f
    if tp is str:
        if not isinstance(value, str):
            errors.append(f"{path}: expected a string, got {brief(value)}")
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
        return load_yaml(text)
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


# nodes a YAML config may have once every alias is expanded: a real config has hundreds; a few
# hundred bytes of nested aliases ("billion laughs") expand to billions, which every later pass
# over the value (type checks, copies, error messages) would pay for in time and memory
YAML_MAX_NODES = 100_000

_CONFIG_LOADER = None


def _config_loader():
    """``yaml.SafeLoader`` (standard tags only: ``!!python/...`` stays refused) that also refuses a
    key given twice in one mapping and aliases that expand past :data:`YAML_MAX_NODES` nodes."""
    global _CONFIG_LOADER
    if _CONFIG_LOADER is not None:
        return _CONFIG_LOADER
    import yaml
    from yaml.constructor import ConstructorError

    class ConfigLoader(yaml.SafeLoader):
        def compose_document(self):
            node = super().compose_document()
            _check_expanded_size(node, YAML_MAX_NODES)
            return node

        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                first: dict = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` keys may be overridden
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        seen = first.get(key)
                    except TypeError:  # an unhashable key: the base class reports it
                        continue
                    if seen is not None:
                        raise ConstructorError(
                            "while constructing a mapping",
                            node.start_mark,
                            f"found the key {brief(key)} twice (first on line {seen.line + 1}); a key given twice "
                            "would silently take its last value: keep one",
                            key_node.start_mark,
                        )
                    first[key] = key_node.start_mark
            return super().construct_mapping(node, deep=deep)

    _CONFIG_LOADER = ConfigLoader
    return ConfigLoader


def _check_expanded_size(root, limit: int) -> None:
    """Raise a ``yaml.YAMLError`` when the node graph under ``root``, with every alias expanded, has
    more than ``limit`` nodes or contains itself. Each distinct node is visited once (sizes are
    memoised), so this costs the size of the file, not of the expansion."""
    import yaml
    from yaml.composer import ComposerError

    sizes: dict[int, int] = {}
    on_path: set[int] = set()

    def size(node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in on_path:
            raise ComposerError(
                None,
                None,
                "found a recursive alias (a node that contains itself); configs cannot hold one",
                node.start_mark,
            )
        on_path.add(key)
        if isinstance(node, yaml.SequenceNode):
            n = 1 + sum(size(c) for c in node.value)
        elif isinstance(node, yaml.MappingNode):
            n = 1 + sum(size(k) + size(v) for k, v in node.value)
        else:
            n = 1
        on_path.discard(key)
        if n > limit:
            raise ComposerError(
                None,
                None,
                f"its aliases expand to more than {limit:,} values (an alias bomb?); a config needs far "
                "fewer: write the values out or use fewer nested aliases",
                node.start_mark,
            )
        sizes[key] = n
        return n

    if root is not None:
        size(root)


def load_yaml(text: str):
    """``yaml.safe_load`` for configs, stricter (see :func:`_config_loader`): one YAML document
    (``None`` if empty); raises ``yaml.YAMLError`` naming the line of a duplicate key or an alias bomb."""
    import yaml

    return yaml.load(text, Loader=_config_loader())


def read_yaml_file(path, what: str) -> dict:
    """The top-level mapping of a YAML config file.

    Raises one ``ConfigError`` (titled ``what``) when the file is not valid YAML, gives a key twice in
    a mapping, has aliases that expand past :data:`YAML_MAX_NODES` values, is empty or holds only
    comments (which would silently mean "all defaults"), or is not a mapping.
    """
    from pathlib import Path

    import yaml

    path = Path(path)
    try:
        data = load_yaml(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError([f"{path}: not valid YAML: {e}"], what) from e
    except RecursionError as e:
        raise ConfigError([f"{path}: not a config: its values are nested too deeply to read"], what) from e
    if data is None or data == {}:
        raise ConfigError(
            [
                f"{path}: the file is empty or holds only comments; write the settings into it (an empty config "
                "would silently mean all defaults)"
            ],
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
