"""The command line of DMuon's config, as data: one ``Flag`` row per flag, naming the config field it
sets. DMuon's own rows are config.py's ``DMUON_FLAGS``, Megatron-LM's ``--muon-*`` rows
megatron_lm_flags.py's ``MEGATRON_MUON_FLAGS``; ``argparse_kwargs`` derives a row's argparse
arguments from the field (its ``Literal`` choices, its default in ``DMuonConfig()``), so a choice, a
default or a range is written once, on the field or its row.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Callable, Mapping, Optional

_FIELD = object()  # a row's default: the field's own


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The numbers a flag takes: [low, high] (``low_open`` / ``high_open``: the ends excluded),
    finite; ``fix`` says what to pass instead."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    fix: str = ""

    def check(self, flag: str, value) -> None:
        """ValueError naming ``flag`` if ``value`` is NaN, infinite or out of range (None and bools
        are not checked: unset, or a switch)."""
        if value is None or isinstance(value, bool):
            return
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        if math.isfinite(value) and above and below:
            return
        fix = f"; {self.fix}" if self.fix else ""
        if isinstance(value, int) and not math.isfinite(self.high):
            raise ValueError(f"{flag} {value} must be an integer >= {self.low}{fix}")
        interval = ("(" if self.low_open else "[") + f"{self.low:g}, " + \
            (f"{self.high:g}" if math.isfinite(self.high) else "inf") + \
            (")" if self.high_open or not math.isfinite(self.high) else "]")
        raise ValueError(f"{flag} {value} must be a finite number in {interval}{fix}")


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag: ``name`` sets the config field at ``path`` (a field of ``DMuonConfig``, or
    'muon.<field>' / 'layout.<field>'; None: read by the config's builder itself, which says how).
    Its argparse choices are the field's ``Literal`` (or ``choices``, or ``words``' keys), its default
    the field's in ``DMuonConfig()`` (or ``default``), a bool field is a switch (``negates``: it sets
    the field to False; ``dest`` and ``action`` for Megatron's own spellings)."""

    name: str
    path: Optional[str]
    help: str
    default: object = _FIELD
    words: Optional[Mapping[str, object]] = None  # the flag's words -> the field's values (dtypes)
    choices: Optional[tuple] = None
    type: Optional[Callable] = None
    metavar: Optional[str] = None
    bounds: Optional[Bounds] = None
    negates: bool = False
    dest_name: Optional[str] = None  # argparse's dest where it is not the flag's name
    action: Optional[str] = None  # 'store_true' / 'store_false' where the field does not say

    @property
    def dest(self) -> str:
        return self.dest_name or self.name[2:].replace("-", "_")

    def field_value(self, value):
        """The field's value for the flag's parsed ``value``."""
        if self.words is not None:
            return self.words[value]
        return not value if self.negates else value

    def flag_value(self, field_value):
        """The flag's value for a field's value (its default on the command line)."""
        if self.words is not None:
            return next(word for word, v in self.words.items() if v == field_value)
        return not field_value if self.negates else field_value

    def check(self, value) -> None:
        """The flag's range check of a field's (or the flag's own) value."""
        if self.bounds is not None:
            self.bounds.check(self.name, value)


def field_of(config, path: str):
    """(value, type hint) of the field at ``path`` of a config object (``section.field`` or a field)."""
    owner = config
    *sections, name = path.split(".")
    for section in sections:
        owner = getattr(owner, section)
    return getattr(owner, name), typing.get_type_hints(type(owner))[name]


def literal_choices(hint) -> Optional[tuple]:
    """The values of a ``Literal`` type (None: not one)."""
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None


def argparse_kwargs(flag: Flag, defaults) -> dict:
    """``add_argument`` keyword arguments of ``flag`` against a default config (``DMuonConfig()``)."""
    value, hint = field_of(defaults, flag.path) if flag.path else (None, None)
    default = flag.flag_value(value) if flag.default is _FIELD else flag.default
    kw = dict(help=flag.help)
    if flag.dest_name:
        kw["dest"] = flag.dest
    if flag.action or hint is bool:
        kw["action"] = flag.action or "store_true"
        if kw["action"] == "store_false" or flag.default is not _FIELD:
            kw["default"] = default
        return kw
    kw["default"] = default
    choices = flag.choices or (tuple(flag.words) if flag.words is not None else literal_choices(hint))
    if choices:
        kw["choices"] = choices
    kind = flag.type or (hint if hint in (int, float) else None)
    if kind is not None:
        kw["type"] = kind
    if flag.metavar:
        kw["metavar"] = flag.metavar
    return kw
