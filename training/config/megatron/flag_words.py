"""The model's problem lines in the words of the command line: flags, not config fields.

`TransformerConfig.problems` (models/) names its fields (`num_moe_experts`,
`add_bias_linear=False`), the right words for a Python user who built the config. A user of
pretrain_gpt.py typed flags, so `build_model_config` rewrites each line it reports:
a field becomes its flag (or, for a setting only a DeepSpeed JSON sets, its key: the table's
`flag_name`), `field=value` becomes the flag with that value (`--disable-bias-linear`,
`--moe-router-score-function sigmoid`), and a flag then repeated in parentheses ("set
--num-experts (--num-experts)") is said once. Fields with no flag keep their names.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Dict, Optional

# field -> (flag, the flag that turns it off): fields whose flag is not the table's row of
# the same name
_SPECIAL = {"add_bias_linear": ("--disable-bias-linear", "--disable-bias-linear"),
            "moe_shared_expert_gate": ("--moe-shared-expert-gate", None)}
_VALUE = r"(?:'[^']*'|\"[^\"]*\"|\[[^\]]*\]|[\w.+-]+)"


@functools.lru_cache(maxsize=None)
def _flags() -> Dict[str, str]:
    """TransformerConfig field -> the name a user of the flags knows it by."""
    from gigatron.models.config import TransformerConfig
    from gigatron.training.config.megatron.model import MODEL_FIELDS
    from gigatron.training.config.megatron.moe import MOE_FIELDS
    from gigatron.training.config.table import table

    rows = {r.dest: r for r in table()}
    dest_of = {field: dest for dest, field in {**MODEL_FIELDS, **MOE_FIELDS}.items()}
    out = {}
    for f in dataclasses.fields(TransformerConfig):
        dest = dest_of.get(f.name, f.name)
        if "_" in f.name and dest in rows:  # one-word fields are also English words
            out[f.name] = rows[dest].name
    out.update({field: flag for field, (flag, _) in _SPECIAL.items()})
    return out


@functools.lru_cache(maxsize=None)
def _pattern() -> "re.Pattern[str]":
    names = sorted(_flags(), key=len, reverse=True)  # longest first: no prefix wins
    return re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, names)) +
                      r")(?:=(" + _VALUE + r"))?(?![\w-])")


def _with_value(field: str, flag: str, value: Optional[str]) -> str:
    if value is None:
        return flag
    off: Optional[str] = _SPECIAL.get(field, (flag, None))[1]
    if field == "add_bias_linear":
        return off if value == "False" else f"biases (no {off})"  # type: ignore[return-value]
    if value == "True":
        return flag
    if value in ("False", "None"):
        return f"no {flag}"
    return f"{flag} {value.strip(chr(39) + chr(34))}"


def in_flag_words(line: str) -> str:
    """`line` with each config field (and field=value) named as on the command line."""
    def rewrite(match: "re.Match[str]") -> str:
        field = match.group(1)
        return _with_value(field, _flags()[field], match.group(2))

    text = re.sub(r"(--[\w-]+) is None", r"\1 is not given", _pattern().sub(rewrite, line))
    # "--flag (--flag)" and "--flag value (--flag value)": said once
    return re.sub(r"(--[\w-]+(?: [\w.'\[\], ]+?)?) \(\1\)", r"\1", text)

