"""`setting(...)`: a dataclass field that knows its Megatron flag and its DeepSpeed JSON key.

Every settable field of a run is declared once, with this helper, on the config dataclass of
its concern (`training/config/run_config.py`, `training/config/settings.py`); `training/config/table.py` reads
the metadata into the one table that argparse, the DeepSpeed-JSON reader and docs/FLAGS.md
are generated from. This module only records the metadata, so anything may import it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

SPEC_KEY = "gigatron.setting"


class _SameDefault:
    """The marker of `ds_default` when DeepSpeed's default is the field's own default."""

    def __repr__(self) -> str:
        return "the field's default"


SAME_DEFAULT: Any = _SameDefault()


@dataclass(frozen=True)
class FieldSpec:
    """How one config field is set: flags (first = canonical, rest = aliases) and JSON key."""

    doc: str
    flags: Tuple[str, ...] = ()
    dest: Optional[str] = None  # the argparse dest; None: the field name
    choices: Optional[Tuple[Any, ...]] = None
    metavar: Optional[str] = None
    negative: Optional[str] = None  # a flag storing False (e.g. --no-progress)
    ds: Optional[str] = None  # DeepSpeed JSON key, dotted: "zero_optimization.stage"
    ds_as: Optional[str] = None  # how the JSON value becomes the flag value (config_table)
    ds_when: Optional[str] = None  # "fp16": read only with fp16 on; "adam"/"sgd": params of
    ds_doc: Optional[str] = None  # how the JSON value maps, when not one to one
    # what gigatron.initialize uses when the JSON leaves the key out (DeepSpeed's default),
    # where it differs from `default` (pretrain_gpt.py's, i.e. Megatron's)
    ds_default: Any = SAME_DEFAULT


def setting(default: Any, doc: str, *flags: str, dest: Optional[str] = None,
            choices: Optional[Sequence[Any]] = None, metavar: Optional[str] = None,
            negative: Optional[str] = None, ds: Optional[str] = None,
            ds_as: Optional[str] = None, ds_when: Optional[str] = None,
            ds_doc: Optional[str] = None, ds_default: Any = SAME_DEFAULT) -> Any:
    """A dataclass field with `default` whose flags, JSON key and one-line doc are recorded;
    `ds_default`: DeepSpeed's default for the JSON key where it differs from `default`."""
    spec = FieldSpec(doc=doc, flags=tuple(flags), dest=dest,
                     choices=None if choices is None else tuple(choices), metavar=metavar,
                     negative=negative, ds=ds, ds_as=ds_as, ds_when=ds_when, ds_doc=ds_doc,
                     ds_default=ds_default)
    return dataclasses.field(default=default, metadata={SPEC_KEY: spec})


def field_spec(f: dataclasses.Field) -> Optional[FieldSpec]:
    """The FieldSpec of a dataclass field, or None for a derived (not settable) field."""
    return f.metadata.get(SPEC_KEY)
