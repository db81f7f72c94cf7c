"""SFT conversations from a JSON-lines file, as Megatron-LM's `--sft` reads them.

Each line is a JSON object whose `"messages"` is a list of {"role", "content"} turns with the
roles system, user and assistant. A line may hold several conversations back to back: each
conversation starts at a system turn (Megatron-LM's SFTDataset splits a line there), and a
line becomes one training sample (its conversations packed, data/sft/packing.py).

Bad lines are found all at once and reported one line each, naming the file and the line.
"""
from __future__ import annotations

import json
from typing import Dict, List, Sequence

Message = Dict[str, str]
Conversation = List[Message]
ROLES = ("system", "user", "assistant")
MAX_REPORTED = 20  # a broken file's first problems; the rest are counted


class SFTDataError(ValueError):
    """Every bad line of a conversations file, one line each."""

    def __init__(self, problems: Sequence[str], total: int) -> None:
        self.problems = list(problems)
        more = f"\n  ... and {total - len(problems)} more" if total > len(problems) else ""
        if len(problems) == 1 and not more:
            super().__init__(problems[0])
        else:
            super().__init__(f"{total} problems in the --sft data:\n"
                             + "\n".join(f"  {p}" for p in problems) + more)


def split_conversations(messages: Sequence[Message]) -> List[Conversation]:
    """A line's messages as conversations: a new one starts at every system turn."""
    conversations: List[Conversation] = []
    for message in messages:
        if message["role"] == "system" or not conversations:
            conversations.append([])
        conversations[-1].append(message)
    return conversations


def _line_problem(record: object) -> str:
    """What is wrong with one parsed line ('' when nothing)."""
    if not isinstance(record, dict) or "messages" not in record:
        return 'no "messages" (each line is {"messages": [{"role": ..., "content": ...}, ...]})'
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        return '"messages" is not a non-empty list of turns'
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return f'turn {i} is not an object with "role" and "content"'
        if m["role"] not in ROLES:
            return (f"turn {i} has the unknown role {m['role']!r} (roles: "
                    f"{', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            return f"turn {i}'s content is not a string"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn: nothing to learn from"
    return ""


def read_conversations(path: str) -> List[List[Conversation]]:
    """The conversations of each non-empty line of `path`; SFTDataError lists bad lines."""
    lines: List[List[Conversation]] = []
    problems: List[str] = []
    total = 0
    try:
        f = open(path, encoding="utf-8")
    except OSError as err:
        raise SFTDataError([f"--data-path {path}: cannot read the --sft file ({err.strerror})"],
                           1) from None
    with f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
                problem = _line_problem(record)
            except json.JSONDecodeError as err:
                problem = f"not JSON ({err.msg} at column {err.colno})"
            if problem:
                total += 1
                if len(problems) < MAX_REPORTED:
                    problems.append(f"{path}:{number}: {problem}")
                continue
            lines.append(split_conversations(record["messages"]))
    if total:
        raise SFTDataError(problems, total)
    if not lines:
        raise SFTDataError([f"{path}: no conversations (the file is empty)"], 1)
    return lines
