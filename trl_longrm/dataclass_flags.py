"""The argparse type of a config dataclass's field, for the `--kebab-case` flags of `python -m trl_longrm.demo` and
`python -m trl_longrm.synthetic` (one definition: both once parsed an `int | None` field's value as text)."""

from __future__ import annotations

import dataclasses
import typing


def flag_type(cls: type, field: dataclasses.Field, default) -> type:
    """The type that converts a flag's text: the default's type, or for a field whose default is None the
    annotation's other member (`int | None`: int; str where the annotation names none)."""
    if default is not None:
        return type(default)
    hint = typing.get_type_hints(cls)[field.name]
    return next((t for t in typing.get_args(hint) if t is not type(None)), str)
