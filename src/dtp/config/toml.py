"""A run as TOML: :func:`to_toml` writes a table per section (what ``--print-config``
prints and the launcher ships to its ranks), :func:`toml_fields` reads one back, or a flat
file of dtp before sections."""

from __future__ import annotations

import json
from typing import Any, Mapping

from .fields import SECTIONS
from .run import _FIELDS, RunConfig, type_error

__all__ = ["section_of", "to_toml", "toml_fields"]


def section_of(name: str) -> str:
    """The section a field is in (:data:`SECTIONS`: its group in ``dtp train --help``, its
    table in a TOML file).

    >>> section_of("dp"), section_of("num_experts"), section_of("save_every")
    ('parallelism', 'moe', 'checkpoint')
    """
    return _FIELDS[name].metadata["section"]


def to_toml(config: RunConfig, *, leave_out: tuple[str, ...] = ()) -> str:
    """``config`` as a TOML document ``dtp train --config`` reads back: a table per section
    (:data:`SECTIONS`), ``None`` fields and those named in ``leave_out`` left out.

    >>> print(to_toml(RunConfig(dp=2, sp=False)).splitlines()[4])
    dp = 2
    >>> "warmup" in to_toml(RunConfig(steps=3), leave_out=("warmup",))
    False
    """
    tables: dict[str, list[str]] = {section: [] for section in SECTIONS}
    for key, value in config.to_dict().items():
        if value is not None and key not in leave_out:
            # JSON's scalars are TOML's (true, 1.5, "s"), but for characters past the BMP, which JSON
            # escapes as surrogate pairs and TOML refuses: written as themselves (UTF-8, as TOML is).
            tables[section_of(key)].append(f"{key} = {json.dumps(value, ensure_ascii=False)}")
    return "\n".join(f"[{section}]\n" + "".join(line + "\n" for line in lines)
                     for section, lines in tables.items() if lines)


def toml_fields(document: Mapping[str, Any]) -> dict[str, Any]:
    """A run's fields from a parsed TOML document: each in its section's table
    (:func:`to_toml`'s form), or at the top level (the flat files of dtp before sections).
    ``ValueError`` names what is wrong: an unknown key or table, a key in another section's
    table, a key given twice, a value of the wrong type. ``compile = true`` is the bare
    ``--compile`` (the field's ``bare`` value).

    >>> toml_fields({"model": "small", "parallelism": {"dp": 2, "sp": True}})
    {'model': 'small', 'dp': 2, 'sp': True}
    >>> toml_fields({"training": {"dp": 2}})
    Traceback (most recent call last):
    ...
    ValueError: dp is a parallelism field: it goes in [parallelism], not [training]
    """
    values: dict[str, Any] = {}
    for key, value in document.items():
        if isinstance(value, dict):
            if key not in SECTIONS:
                raise ValueError(f"[{key}] is not a section of a run; the tables are "
                                 f"{', '.join(f'[{s}]' for s in SECTIONS)} (or the fields at the top level)")
            entries = [(k, v, key) for k, v in value.items()]
        else:
            entries = [(key, value, None)]
        for k, v, table in entries:
            if isinstance(v, dict):
                raise ValueError(f"[{table}.{k}] is a table in a table; the fields sit in their section's table "
                                 f"([{table}]) or at the top level")
            if k not in _FIELDS:
                raise ValueError(f"unknown key {k!r}; the keys are dtp.RunConfig's fields, the train flags' names "
                                 f"with '_' ({', '.join(list(_FIELDS)[:6])}, ...)")
            if table is not None and section_of(k) != table:
                raise ValueError(f"{k} is a{'n' * (section_of(k)[0] in 'aeiou')} {section_of(k)} field: it goes in "
                                 f"[{section_of(k)}], not [{table}]")
            bare = _FIELDS[k].metadata["bare"]
            if bare is not None and isinstance(v, bool):  # `compile = true` reads as the bare --compile
                v = bare if v else None
            wrong = type_error(k, v)
            if wrong:  # here, not in the parser: it would parse a string default with the flag's type
                raise ValueError(f"{k} {wrong}")
            if k in values:  # dp = 2 at the top and in [parallelism]: one would win silently
                raise ValueError(f"{k} is given twice ({values[k]!r} and {v!r}); keep one")
            values[k] = v
    return values
