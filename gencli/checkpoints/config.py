"""One reader for model configs: a ``config.json`` dict into a config dataclass.

:func:`read_config` fills each field of the dataclass from the key of the same name (or the names
``renames`` gives it), converts the value to the field's annotated type (``int``, ``float``, ``bool``,
``str``, tuples, ``Optional[...]``, nested config dataclasses), and leaves the dataclass default
where the key is absent or ``null``. Keys the dataclass does not know are ignored, as transformers
and diffusers ignore them. A missing required key or a value of the wrong kind is a
:class:`ConfigError` that names the key and the file. Values a config computes from several keys
are passed in by the caller and win over the dict. :func:`config_to_dict` is the way back.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Mapping, Optional, Sequence, TypeVar, Union

from gencli.errors import CheckpointError

C = TypeVar("C")


class ConfigError(CheckpointError, ValueError):
    """A config that cannot describe the model: a missing required key, or a value of the wrong kind."""


def read_config(
    cls: type[C],
    data: Mapping[str, Any],
    *,
    where: str = "config.json",
    what: Optional[str] = None,
    required: Sequence[str] = (),
    renames: Optional[Mapping[str, Union[str, Sequence[str]]]] = None,
    **values: Any,
) -> C:
    """An instance of the dataclass ``cls`` from the config dict ``data``.

    ``required``: keys that must be present (and not null); ``what`` names the model in that error
    ("a GPT-2 model"). ``renames``: a field's key in the file when it differs from the field's name,
    or several keys tried in order (the first present wins). ``values``: fields the caller computed;
    they are taken as given. ``where`` names the file in errors."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must hold a JSON object, not {type(data).__name__}")
    missing = [k for k in required if data.get(k) is None]
    if missing:
        raise ConfigError(f"{where} lacks '{missing[0]}'" + (f" needed by {what}" if what else ""))
    hints = typing.get_type_hints(cls)
    renames = renames or {}
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init:
            continue
        if f.name in values:
            kwargs[f.name] = values[f.name]
            continue
        keys = renames.get(f.name, f.name)
        keys = (keys,) if isinstance(keys, str) else tuple(keys)
        key = next((k for k in keys if data.get(k) is not None), None)
        if key is not None:
            kwargs[f.name] = convert(data[key], hints[f.name], key, where)
    unknown = set(values) - {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {sorted(unknown)[0]!r}")
    return cls(**kwargs)


def convert(value: Any, annotation: Any, key: str, where: str = "config.json") -> Any:
    """``value`` as the type ``annotation`` names; a :class:`ConfigError` naming ``key`` when it is not one."""
    try:
        return _convert(value, annotation, key, where)
    except ConfigError:
        raise
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{where}: '{key}' must be {_describe(annotation)}, got {value!r}") from None


def _convert(value: Any, annotation: Any, key: str, where: str) -> Any:
    if value is None or annotation is Any:
        return value
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _convert(value, options[0], key, where)
        for option in options:  # the first that takes the value as it is
            if _is_instance(value, option):
                return _convert(value, option, key, where)
        return _convert(value, options[0], key, where)
    if dataclasses.is_dataclass(annotation):
        return read_config(annotation, value, where=f"{where} ({key})")
    if annotation is bool:
        if isinstance(value, bool) or value in (0, 1):
            return bool(value)
        raise ValueError(value)
    if annotation is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(value)
        return int(value)
    if annotation is float:
        if isinstance(value, bool):
            raise ValueError(value)
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ValueError(value)
        return value
    if origin is tuple:
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
            raise ValueError(value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], key, where) for v in value)
        if args and len(args) != len(value):
            raise ValueError(value)
        return tuple(_convert(v, a, key, where) for v, a in zip(value, args)) if args else tuple(value)
    if origin is list:
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
            raise ValueError(value)
        return [_convert(v, args[0], key, where) for v in value] if args else list(value)
    if origin is dict or annotation is dict:
        if not isinstance(value, Mapping):
            raise ValueError(value)
        return dict(value)
    return value


def _is_instance(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation) or annotation
    if origin is tuple or origin is list:
        return isinstance(value, (list, tuple))
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(origin, type) and isinstance(value, origin)


def _describe(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args if a is not type(None))
    if origin in (tuple, list):
        plural = {int: "integers", float: "numbers", bool: "booleans", str: "strings"}
        return "a list" + (f" of {plural.get(args[0], _describe(args[0]))}" if args and args[0] is not Ellipsis else "")
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def config_to_dict(config: Any, *, drop: Sequence[str] = ()) -> dict[str, Any]:
    """A config dataclass as a JSON-ready dict (tuples as lists, nested configs as dicts), without ``drop``."""

    def plain(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return {k: plain(v) for k, v in dataclasses.asdict(config).items() if k not in drop}


class JsonConfig:
    """A config dataclass stored as its own ``config.json``: :meth:`from_dict` and :meth:`to_dict`."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        return read_config(cls, d)

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)
