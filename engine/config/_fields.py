"""Typed field machinery shared by the config sections: type coercion, text parsing, key errors.

Every config section is a ``@dataclass(kw_only=True)`` whose annotations are the single source of
truth for types. The same annotations drive three things:

* ``coerce(value, annotation, name=...)``: check a native value (from TOML, JSON or Python) against
  the annotation, converting only where it is lossless (``int`` -> ``float``, an integral
  ``float`` -> ``int``, a tuple -> list);
* ``parse_text(text, annotation, name=...)``: turn a ``--set`` string into a native value of that
  type (``"none"`` for ``Optional``, ``true/false/1/0`` for ``bool``, comma lists or TOML arrays);
* ``unknown_key_error(...)``: the error for a misspelled key, listing the valid keys and the closest
  match.

Errors are ``ValueError``s that name the dotted field (``optim.lr``) and say what to write instead.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import tomllib
import types
import typing
from typing import Any

_NONE_WORDS = ("none", "null")
_TRUE_WORDS = ("true", "1")
_FALSE_WORDS = ("false", "0")


def unknown_key_error(key: str, *, valid: list[str], where: str, what: str = "key",
                      elsewhere: list[str] = ()) -> ValueError:
    """A ValueError for ``key`` not being one of ``valid`` in ``where`` ("section [optim]"),
    suggesting the key of that name in another section (``elsewhere``: "optim.zero_stage", ...), else the
    closest valid name, and listing all of them."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = (f"; it belongs to {' or '.join(elsewhere)}." if elsewhere else
            f"; did you mean '{close[0]}'?" if close else ".")
    return ValueError(f"unknown {what} '{key}' in {where}{hint} Valid {what}s: "
                      f"{', '.join(sorted(valid))}")


def _split_optional(annotation: Any) -> tuple[Any, bool]:
    """(inner type, is_optional) for ``X | None``; (annotation, False) otherwise."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        assert len(args) == 1, f"config fields support only 'X | None' unions, got {annotation}"
        return args[0], True
    return annotation, False


def type_name(annotation: Any) -> str:
    """Human-readable name of a field type, e.g. 'list of float, or none'."""
    inner, optional = _split_optional(annotation)
    if typing.get_origin(inner) is list:
        (elem,) = typing.get_args(inner)
        text = f"list of {elem.__name__}"
    else:
        text = inner.__name__
    return f"{text}, or none" if optional else text


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def coerce(value: Any, annotation: Any, *, name: str) -> Any:
    """Return ``value`` checked against (and losslessly converted to) ``annotation``.

    Raises ValueError naming ``name`` (the dotted field) when the value does not fit.
    """
    inner, optional = _split_optional(annotation)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{name} cannot be none (type: {type_name(annotation)}); give it "
                         "a value, or leave it out to use the default")
    if isinstance(inner, type) and issubclass(inner, Section):  # a nested section, e.g. posttrain.lora
        if isinstance(value, inner):
            return value
        if isinstance(value, dict):
            return inner.from_dict(value)
        raise ValueError(f"{name} is a table of keys ([{name}] in TOML, or --set {name}.KEY=VALUE), "
                         f"got {_describe(value)}")
    if typing.get_origin(inner) is list:
        (elem,) = typing.get_args(inner)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name} expects a list of {elem.__name__}, got {_describe(value)}; "
                             f"write a list, e.g. TOML [\"a\", \"b\"] or --set {name}=a,b")
        return [coerce(v, elem, name=f"{name}[{i}]") for i, v in enumerate(value)]
    if inner is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{name} expects a bool, got {_describe(value)}; write true or false")
    if inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"{name} expects an integer, got {_describe(value)}; write a whole "
                         "number without quotes")
    if inner is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"{name} expects a number, got {_describe(value)}; write it without "
                         "quotes, e.g. 3e-4")
    if inner is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{name} expects a string, got {_describe(value)}; quote it in TOML")
    raise AssertionError(f"unsupported config field type {annotation} for {name}")


def _parse_scalar(text: str, annotation: Any, *, name: str) -> Any:
    word = text.strip()
    if annotation is bool:
        if word.lower() in _TRUE_WORDS:
            return True
        if word.lower() in _FALSE_WORDS:
            return False
        raise ValueError(f"{name} expects a bool, got '{text}'; write true, false, 1 or 0")
    if annotation is int:
        try:
            return int(word)
        except ValueError:
            pass
        try:
            number = float(word)
        except ValueError:
            number = None
        if number is not None and number.is_integer():
            return int(number)
        raise ValueError(f"{name} expects an integer, got '{text}'; write a whole number, e.g. 8")
    if annotation is float:
        try:
            return float(word)
        except ValueError:
            raise ValueError(f"{name} expects a number, got '{text}'; write "
                             "e.g. 3e-4 or 0.1") from None
    if annotation is str:
        if len(word) >= 2 and word[0] == word[-1] and word[0] in "\"'":
            return _toml_value(word, name=name)
        return word
    raise AssertionError(f"unsupported config field type {annotation} for {name}")


def _toml_value(text: str, *, name: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{name}: cannot parse '{text}' as a TOML value ({err}); write e.g. "
                         "[1, 2] or \"text\"") from None


def parse_text(text: str, annotation: Any, *, name: str) -> Any:
    """Parse the right-hand side of ``--set name=text`` by the field's annotation.

    ``none``/``null`` means None for optional fields. Lists take ``a,b,c`` (elements parsed by the
    element type; an empty string is the empty list) or a TOML array ``[1, 2]``.
    """
    inner, optional = _split_optional(annotation)
    if optional and text.strip().lower() in _NONE_WORDS:
        return None
    if typing.get_origin(inner) is list:
        (elem,) = typing.get_args(inner)
        stripped = text.strip()
        if stripped.startswith("["):
            return coerce(_toml_value(stripped, name=name), inner, name=name)
        if not stripped:
            return []
        parts = [p.strip() for p in stripped.split(",")]
        return [_parse_scalar(p, elem, name=f"{name}[{i}]") for i, p in enumerate(parts)]
    return _parse_scalar(text, inner, name=name)


def field_types(cls: type) -> dict[str, Any]:
    """{field name: resolved annotation} of a config dataclass, in declaration order (a fresh dict)."""
    return dict(_field_types(cls))


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    # Resolved once per class: typing.get_type_hints evaluates every annotation string of the class and its
    # bases, and each section validates its fields on every construction (0.1 s of every load_config)
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


class Section:
    """Base of every config section: type-checks all fields, then runs the section's ``_validate``.

    Sections are frozen dataclasses, so a config stays what was validated and logged; derive a
    changed one with ``dataclasses.replace`` (which validates again).

    Subclasses set ``SECTION`` (their key in the root config, used in error messages) and implement
    ``_validate`` with the range and consistency checks of that section alone.
    """

    SECTION: typing.ClassVar[str] = ""

    def __post_init__(self) -> None:
        for key, annotation in field_types(type(self)).items():
            value = coerce(getattr(self, key), annotation, name=f"{self.SECTION}.{key}")
            object.__setattr__(self, key, value)  # sections are frozen
        self._validate()

    def _validate(self) -> None:
        raise NotImplementedError

    @classmethod
    def field_default(cls, name: str) -> Any:
        """The default of field ``name`` (a fresh one for a default factory)."""
        f = cls.__dataclass_fields__[name]
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        if f.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{name} has no default")
        return f.default

    def changed(self, *names: str) -> list[str]:
        """Those of ``names`` (all fields when none are given) whose values differ from their defaults: the
        keys a config set, for refusing a key that the chosen mode does not read."""
        return [n for n in (names or self.__dataclass_fields__) if getattr(self, n) != self.field_default(n)]

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        """Build the section from a plain dict; unknown keys are an error listing the valid ones."""
        if not isinstance(data, dict):
            raise ValueError(f"[{cls.SECTION}] must be a table of keys, got {_describe(data)}")
        valid = list(field_types(cls))
        for key in data:
            if key not in valid:
                raise unknown_key_error(key, valid=valid, where=f"section [{cls.SECTION}]")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """The section as plain JSON/TOML-ready data (lists copied, nested sections as tables)."""
        def plain(v):
            return v.to_dict() if isinstance(v, Section) else list(v) if isinstance(v, list) else v
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
