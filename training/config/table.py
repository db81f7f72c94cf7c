"""The one config table: every settable field of a run, read from the config dataclasses.

Each row is one field declared with `field.setting` (its type from the annotation, its
default, doc, flags and DeepSpeed key) on the dataclass of its concern; `Settings` holds one
dataclass per concern. Generated from it: pretrain_gpt.py's argparse (`build_parser`), the
typed settings of parsed flags (`build_settings`), the DeepSpeed-JSON reader
(`training/config/deepspeed/pretrain.py`), docs/FLAGS.md (`flags_markdown`; regenerate with
`python -m gigatron.training.config.table > docs/FLAGS.md`). Nothing here imports torch:
`--help` stays instant.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any, Dict, List, NoReturn, Optional, Sequence, Tuple

from gigatron.training.config.field import SAME_DEFAULT, FieldSpec, field_spec
from gigatron.training.config.megatron.accepted import AcceptedSettings
from gigatron.training.config.megatron.fp8 import FP8Settings
from gigatron.training.config.megatron.gpt_oss import GptOssSettings
from gigatron.training.config.megatron.mla import MLASettings
from gigatron.training.config.megatron.moe import MoESettings
from gigatron.training.config.megatron.mtp import MTPSettings
from gigatron.training.config.megatron.recompute import RecomputeSettings
from gigatron.training.config.megatron.tp_comm import TPCommSettings
from gigatron.training.config.megatron.muon import MuonSettings
from gigatron.training.config.run_config import (CheckpointConfig, LoggingConfig,
                                                 ParallelConfig, TrainConfig)
from gigatron.training.config.settings import (DataSettings, ImplementationSettings,
                                               LossSettings, ModelSettings, OptimizerSettings,
                                               PrecisionSettings, SourceSettings)
from gigatron.training.observe.profiling import ProfilingSettings
from gigatron.training.run.decoupled_lr import DecoupledLRSettings


def _concern(title: str) -> Any:
    """A Settings field: one concern's dataclass; `title` heads its --help group and
    FLAGS.md section."""
    return dataclasses.field(metadata={"title": title})


@dataclass(frozen=True)
class Settings:
    """Every row of the table as a typed value, one dataclass per concern, in --help order:
    what the flags (and the DeepSpeed JSON) say, before anything is derived from it. Built
    once per run (`build_settings`); validation and every feature read it, never the flags."""

    model: ModelSettings = _concern("model (flags override the --model zoo config)")
    moe: MoESettings = _concern("mixture of experts (flags override the --model zoo config)")
    gpt_oss: GptOssSettings = _concern(
        "sliding windows, sinks and gated activations (gpt-oss; flags override --model)")
    mla: MLASettings = _concern(
        "multi-latent attention and YaRN RoPE (DeepSeek-V2/V3; flags override --model)")
    mtp: MTPSettings = _concern("multi-token prediction (DeepSeek-V3)")
    recompute: RecomputeSettings = _concern(
        "selective recomputation (docs/PERFORMANCE.md, Memory without full recompute)")
    parallel: ParallelConfig = _concern("parallelism")
    tp_comm: TPCommSettings = _concern(
        "tensor-parallel communication overlap (docs/PERFORMANCE.md)")
    precision: PrecisionSettings = _concern("precision and ZeRO")
    fp8: FP8Settings = _concern("FP8 (torch._scaled_mm: docs/FP8.md)")
    optimizer: OptimizerSettings = _concern("optimizer and learning-rate schedule")
    muon: MuonSettings = _concern("Muon (--optimizer muon: docs/MUON.md)")
    decoupled_lr: DecoupledLRSettings = _concern(
        "learning rate of the embedding and output layer")
    data: DataSettings = _concern("data and tokenizer")
    train: TrainConfig = _concern("training loop")
    loss: LossSettings = _concern("loss normalisation")
    checkpoint: CheckpointConfig = _concern("checkpointing")
    logging: LoggingConfig = _concern("logging")
    profiling: ProfilingSettings = _concern("profiling")
    implementation: ImplementationSettings = _concern(
        "implementation selectors (the same numbers whichever is chosen)")
    accepted: AcceptedSettings = _concern(
        "speed, memory, kernel and NCCL switches (accepted: the same numbers)")
    source: SourceSettings = _concern("configuration file")

    def value(self, dest: str) -> Any:
        """The typed value of the row whose argparse dest is `dest`."""
        row = row_of(dest)
        return getattr(getattr(self, row.concern), row.field)


# (config dataclass, Settings attribute, argparse group / FLAGS.md section), in --help order
CONCERNS: Tuple[Tuple[type, str, str], ...] = tuple(
    (typing.get_type_hints(Settings)[f.name], f.name, f.metadata["title"])
    for f in dataclasses.fields(Settings))


@dataclass(frozen=True)
class Row:
    """One settable field: where it lives, how it is typed, how it is named."""

    owner: type
    concern: str  # the Settings attribute that holds the owner
    field: str
    dest: str  # the argparse dest (the key of RunConfig.flags)
    type: type  # int, float, str or bool (of a list: the element type)
    is_list: bool
    optional: bool  # None is a value ("not given")
    default: Any
    spec: FieldSpec

    @property
    def flag(self) -> Optional[str]:
        """The canonical flag; None for a field only the DeepSpeed JSON sets."""
        return self.spec.flags[0] if self.spec.flags else None

    @property
    def name(self) -> str:
        """How a user names this setting in a message: its flag, else its JSON key."""
        return self.flag or str(self.spec.ds)


def _base_type(hint: Any) -> Tuple[type, bool, bool]:
    """(element type, is a list, Optional) of an annotation like Optional[List[str]]."""
    optional = False
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    if typing.get_origin(hint) in (list, List):
        return typing.get_args(hint)[0], True, optional
    return hint, False, optional


def _rows(cls: type, concern: str) -> List[Row]:
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        spec = field_spec(f)
        if spec is None:
            continue
        kind, is_list, optional = _base_type(hints[f.name])
        rows.append(Row(cls, concern, f.name, spec.dest or f.name, kind, is_list, optional,
                        f.default, spec))
    return rows


@functools.lru_cache(maxsize=None)
def table() -> Tuple[Row, ...]:
    """Every row, in CONCERNS order; a dest, flag or JSON key appears once."""
    rows = tuple(r for cls, concern, _ in CONCERNS for r in _rows(cls, concern))
    duplicated = []
    for names in ([r.dest for r in rows], [f for r in rows for f in r.spec.flags],
                  [r.spec.ds for r in rows if r.spec.ds]):
        duplicated += sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise AssertionError(f"config table names used twice: {duplicated}")
    return rows


@functools.lru_cache(maxsize=None)
def _by_dest() -> Dict[str, Row]:
    return {r.dest: r for r in table()}


def row_of(dest: str) -> Row:
    """The row of an argparse dest."""
    return _by_dest()[dest]


def flag_name(dest: str) -> str:
    """The flag (or JSON key) a message names for `dest`."""
    return row_of(dest).name


def build_settings(flags: argparse.Namespace) -> Settings:
    """The typed settings of parsed flags: each concern's dataclass from its rows."""
    return Settings(**{concern: cls(**{r.field: getattr(flags, r.dest) for r in table()
                                       if r.concern == concern})
                       for cls, concern, _ in CONCERNS})


def flag_values(settings: Settings) -> Dict[str, Any]:
    """dest -> value of every row: the record of a run's settings that its checkpoints'
    metadata and the Weights & Biases config keep (the flags' names, as Megatron's args)."""
    return {r.dest: getattr(getattr(settings, r.concern), r.field) for r in table()}


def deepspeed_default(row: Row) -> Any:
    """The value gigatron.initialize gives a DeepSpeed key the JSON leaves out: DeepSpeed's
    default (pretrain_gpt.py keeps the flag's default, `row.default`)."""
    return row.default if row.spec.ds_default is SAME_DEFAULT else row.spec.ds_default


def defaults() -> Dict[str, Any]:
    """dest -> default of every row; JSON-only rows start at None ("the JSON did not say")."""
    return {r.dest: r.default if r.flag else None for r in table()}


class ParseProblems(ValueError):
    """Every bad flag value and unknown flag of one command line (one line each); `flags`:
    the rest of the command line parsed (bad values at their defaults), so the caller can
    add the problems of the values that did parse (`arguments.parse_args`)."""

    def __init__(self, problems: Sequence[str], flags: Optional[argparse.Namespace] = None,
                 bad_flags: Sequence[str] = ()) -> None:
        from gigatron.training.config.validation import join_problems

        self.problems, self.flags, self.bad_flags = list(problems), flags, list(bad_flags)
        super().__init__(join_problems(self.problems))


def _shown(value: Any) -> str:
    return str(value).replace("%", "%%")


def _help(row: Row) -> str:
    return f"{row.spec.doc} (default: {_shown(row.default)})"


def _converter(row: Row, problems: List[str]):
    """argparse `type` that records a bad value or choice instead of stopping at the first."""
    def convert(text: str) -> Any:
        try:
            value = row.type(text)
        except ValueError:
            problems.append(f"argument {row.flag}: invalid {row.type.__name__} value: "
                            f"{text!r}")
            return None
        if row.spec.choices is not None and value not in row.spec.choices:
            problems.append(f"argument {row.flag}: invalid choice: {value!r} (choose from "
                            f"{', '.join(map(str, row.spec.choices))})")
            return None
        return value
    convert.__name__ = row.type.__name__
    return convert


def add_row(group: "argparse._ArgumentGroup", row: Row, problems: List[str]) -> None:
    """The argparse argument(s) of one row."""
    if row.type is bool:
        default = None if row.optional else bool(row.default)  # a True default: --no-X turns it off
        group.add_argument(*row.spec.flags, dest=row.dest, action="store_true",
                           default=default, help=_help(row))
        if row.spec.negative:
            group.add_argument(row.spec.negative, dest=row.dest, action="store_false",
                               help=f"the opposite of {row.flag}")
        return
    metavar = row.spec.metavar
    if row.spec.choices is not None:
        metavar = "{" + ",".join(map(str, row.spec.choices)) + "}"
    group.add_argument(*row.spec.flags, dest=row.dest, type=_converter(row, problems),
                       default=row.default, nargs="*" if row.is_list else None,
                       metavar=metavar, help=_help(row))


class ConfigParser(argparse.ArgumentParser):
    """argparse that reports every bad value and unknown flag at once, as a ValueError."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.problems: List[str] = []
        self.suggested: List[str] = []  # the known flags an unknown one was probably meant as

    def error(self, message: str) -> NoReturn:
        raise ParseProblems([message])

    def parse_args(self, args: Optional[Sequence[str]] = None,  # type: ignore[override]
                   namespace: Optional[argparse.Namespace] = None) -> argparse.Namespace:
        """Parse; unknown flags and bad values raise one ParseProblems listing them all."""
        self.problems.clear()
        self.suggested.clear()
        flags, unknown = self.parse_known_args(args, namespace)
        problems = list(self.problems)
        if unknown:
            problems[:0] = [self._unknown(unknown)] + megatron_notes(unknown)
        if problems:
            bad = [m.split()[1].rstrip(":") for m in self.problems]
            for row in table():  # a bad value leaves its flag at the default
                if row.flag in bad:
                    setattr(flags, row.dest, row.default)
            raise ParseProblems(problems, flags, bad + self.suggested)
        return flags

    def _unknown(self, unknown: List[str]) -> str:
        """One line naming every unknown flag, each with its nearest known spelling."""
        from gigatron.training.config.megatron.doc import megatron_flag_note
        from gigatron.training.config.spelling import nearest

        known = [s for a in self._actions for s in a.option_strings]
        names = [u.split("=")[0] for u in unknown if u.startswith("-")] or unknown[:1]
        # a Megatron flag gigatron does not support gets its own line (megatron_notes)
        names = [n for n in names if not megatron_flag_note(n)]
        hints = []
        for name in names:
            close = nearest(name, known)
            if close:
                hints.append(close if len(names) == 1 else f"{close} for {name}")
                self.suggested.append(close)
        hint = f"; did you mean {', '.join(hints)}?" if hints else ""
        if len(hints) < len(names):
            hint += f"; see {self.prog} --help"
        return f"unknown flag(s) {' '.join(unknown)}{hint}"


def megatron_notes(unknown: Sequence[str]) -> List[str]:
    """For each unknown flag that is a Megatron flag: why gigatron does not support it."""
    from gigatron.training.config.megatron.doc import megatron_flag_note

    notes = [megatron_flag_note(u.split("=")[0]) for u in unknown if u.startswith("-")]
    return [note for note in notes if note]


def build_parser(prog: str, description: str) -> ConfigParser:
    """The argparse parser of every row with a flag; JSON-only rows become plain defaults."""
    from gigatron.training.config.help import add_help_flags

    parser = ConfigParser(prog=prog, description=description, allow_abbrev=False,
                          add_help=False)
    add_help_flags(parser)  # --help: the common flags by group; --help-all: every flag
    for cls, _, title in CONCERNS:
        group = parser.add_argument_group(title)
        for row in table():
            if row.owner is cls and row.flag:
                add_row(group, row, parser.problems)
    parser.set_defaults(**{r.dest: None for r in table() if not r.flag})
    return parser


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|")


def flags_markdown() -> str:
    """docs/FLAGS.md: one table per concern, generated from the config table."""
    lines = ["# pretrain_gpt.py flags and DeepSpeed JSON keys", "",
             "Generated from the config table (`training/config/table.py` in the checkout, "
             "which gathers the `setting(...)` rows of the config classes); do not edit by "
             "hand:", "`python -m gigatron.training.config.table > docs/FLAGS.md`.",
             "A DeepSpeed key fills the flag when the flag is not given; both given and "
             "different is an error.",
             "A key the JSON leaves out keeps the flag's default in pretrain_gpt.py; "
             "`gigatron.initialize` gives it DeepSpeed's default, shown where it differs.", ""]
    for cls, _, title in CONCERNS:
        lines += [f"## {title}", "", "| flag | DeepSpeed key | default | meaning |",
                  "|---|---|---|---|"]
        for r in table():
            if r.owner is not cls:
                continue
            flags = ", ".join(f"`{f}`" for f in r.spec.flags + (
                (r.spec.negative,) if r.spec.negative else ())) or "(JSON only)"
            ds = f"`{r.spec.ds}`" if r.spec.ds else ""
            if r.spec.ds and r.spec.ds_default not in (SAME_DEFAULT, None):
                ds += f" (DeepSpeed default `{r.spec.ds_default}`)"
            if r.spec.ds_doc:
                ds += f" ({r.spec.ds_doc})"
            lines.append(f"| {_cell(flags)} | {_cell(ds)} | `{_cell(r.default)}` | "
                         f"{_cell(r.spec.doc)} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(flags_markdown(), end="")
