"""The nearest valid spelling of a misspelt name: the one helper behind every "did you mean"
of flags, DeepSpeed keys, optimizer and scheduler types and their params."""
from __future__ import annotations

import difflib
from typing import Iterable, Optional


def nearest(name: str, choices: Iterable[str], *, ignore_case: bool = False,
            cutoff: float = 0.6) -> Optional[str]:
    """The choice spelled most like `name` (difflib's ratio >= cutoff), as the choice is
    spelled; None when none is close enough."""
    options = list(choices)
    by_key = {(c.lower() if ignore_case else c): c for c in options}
    key = str(name).lower() if ignore_case else str(name)
    close = difflib.get_close_matches(key, list(by_key), n=1, cutoff=cutoff)
    return by_key[close[0]] if close else None


def did_you_mean(name: str, choices: Iterable[str], *, ignore_case: bool = False) -> str:
    """'; did you mean X?' for the nearest choice, or '' (appended to a problem line)."""
    close = nearest(name, choices, ignore_case=ignore_case)
    return f"; did you mean {close}?" if close else ""
