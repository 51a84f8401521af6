"""What the data steps that ask models share: their model lists from a recipe, seeds of their own per request, and
records taken in rounds (a round's requests go out together, so that servers and vLLM batch them)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from trl_longrm.data.errors import RunConfigError
from trl_longrm.datagen.models import ModelSpec
from trl_longrm.datagen.records import Location, record_id


def model_specs(raw, where: str) -> list[ModelSpec]:
    """A step's models (mappings or `ModelSpec`s), at least one, their names unique."""
    if isinstance(raw, (dict, ModelSpec)):
        raw = [raw]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise RunConfigError(f"{where}: give at least one model (a list of mappings with `name`, `backend`, ...)")
    specs = [ModelSpec.from_dict(item, f"{where}[{i}]") for i, item in enumerate(raw)]
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise RunConfigError(f"{where}: model names must be unique, got {names}")
    return specs


def request_seed(seed: int, *parts) -> int:
    """A request's own seed from the step's `seed` and what names the request (record, model, ...): the same
    request draws the same answers in any run, whatever else is in its batch."""
    digest = hashlib.sha256("\x00".join(map(str, (seed, *parts))).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def rounds(source, done: set[str], size: int) -> Iterator[list[tuple[Location, str, dict]]]:
    """The records of `source` not in `done`, `size` at a time, as `(location, id, record)`."""
    batch = []
    for where, record in source:
        rid = record_id(where, record)
        if rid in done:
            continue
        batch.append((where, rid, record))
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
