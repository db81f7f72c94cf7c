"""Which hosts and device slots a job may use, in the spellings users bring.

DeepSpeed's hostfile (`worker-0 slots=4`, MPI style), its `--include/--exclude` filters
(`NODE_SPEC[@NODE_SPEC ...]` with `NODE_SPEC = HOST[:SLOT[,SLOT ...]]`) and Horovod's host
list (`-H h1:2,h2:2`). Pure functions over text: no files, no processes. Every error is one
`LaunchError` line naming the flag (or the hostfile line) and the fix.
"""
from __future__ import annotations

import re
from typing import Dict, List, Mapping

# host -> device ids this job may use on it, in hostfile order (DeepSpeed's "world info")
Resources = Dict[str, List[int]]

_HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")
_HOST_NAME = re.compile(r"^[A-Za-z0-9_.\-\[\]]+$")


class LaunchError(ValueError):
    """A launch that cannot start as asked; the message is one line naming the fix."""


def parse_hostfile(text: str, source: str = "hostfile") -> Dict[str, int]:
    """`host slots=N` lines -> {host: N} in file order; `#` comments and blank lines skip.

    As in DeepSpeed, anything after `slots=N` on a line is ignored (`max_slots=8`, a
    comment), a host listed twice or a line of another shape is an error, and so is a file
    with no host at all.
    """
    pool: Dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _HOSTFILE_LINE.match(line)
        if not match:
            raise LaunchError(f"{source} line {number}: bad entry {line!r}: write one "
                              f"`HOST slots=N` per line (e.g. `worker-0 slots=8`)")
        host, slots = match.group(1), int(match.group(2))
        if host in pool:
            raise LaunchError(f"{source} line {number}: host {host!r} is listed twice: "
                              f"keep one `{host} slots=N` line")
        if slots < 1:
            raise LaunchError(f"{source} line {number}: host {host!r} has slots=0: give it "
                              f"at least one slot or remove the line")
        pool[host] = slots
    if not pool:
        raise LaunchError(f"{source} is empty or not formatted correctly: write one "
                          f"`HOST slots=N` line per node")
    return pool


def parse_horovod_hosts(spec: str) -> Dict[str, int]:
    """Horovod's `-H h1:2,h2:4` -> {h1: 2, h2: 4}; a host without `:N` has one slot."""
    pool: Dict[str, int] = {}
    for item in spec.split(","):
        host, _, count = item.strip().partition(":")
        if not host or not _HOST_NAME.match(host) or (count and not count.isdigit()):
            raise LaunchError(f"-H {spec!r}: bad host {item!r}: write HOST:SLOTS[,HOST:SLOTS] "
                              f"(e.g. -H node1:4,node2:4)")
        if host in pool:
            raise LaunchError(f"-H {spec!r}: host {host!r} is listed twice: list each host once")
        slots = int(count) if count else 1
        if slots < 1:
            raise LaunchError(f"-H {spec!r}: host {host!r} has 0 slots: give it at least one")
        pool[host] = slots
    return pool


def parse_node_specs(spec: str, flag: str) -> Dict[str, List[int]]:
    """`host1:0,1@host2` -> {host1: [0, 1], host2: []} (an empty list: the whole host).

    A host named twice has its slots merged, sorted and de-duplicated, as DeepSpeed does.
    """
    nodes: Dict[str, List[int]] = {}
    for node in spec.split("@"):
        host, colon, slot_text = node.partition(":")
        if not host or ":" in slot_text or (colon and not slot_text):
            raise LaunchError(f"{flag} {spec!r}: bad node spec {node!r}: write "
                              f"HOST[:SLOT[,SLOT...]][@HOST...] (e.g. {flag} worker-0:0,1@worker-1)")
        slots = []
        for slot in slot_text.split(",") if colon else []:
            if not slot.strip().isdigit():
                raise LaunchError(f"{flag} {spec!r}: slot {slot!r} of host {host!r} is not a "
                                  f"device number: write HOST:0,1")
            slots.append(int(slot))
        nodes[host] = sorted(set(nodes.get(host, []) + slots))
    return nodes


def _check_known(nodes: Mapping[str, List[int]], pool: Mapping[str, List[int]],
                 flag: str) -> None:
    for host, slots in nodes.items():
        if host not in pool:
            raise LaunchError(f"{flag}: host {host!r} is not in the hostfile (hosts: "
                              f"{', '.join(pool)}): name one of them")
        missing = [s for s in slots if s not in pool[host]]
        if missing:
            raise LaunchError(f"{flag}: host {host!r} has no slot {missing[0]} (slots: "
                              f"{','.join(map(str, pool[host]))}): name one of those")


def filter_resources(pool: Mapping[str, List[int]], include: str = "",
                     exclude: str = "") -> Resources:
    """DeepSpeed's `--include`/`--exclude` applied to {host: slots}; hosts keep pool order.

    `--include` keeps only the named hosts (all their slots, or the listed ones);
    `--exclude` drops the named hosts, or the listed slots of them. The two are mutually
    exclusive. A host left with no slot is dropped.
    """
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive: give one of them")
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    result: Resources = {host: list(slots) for host, slots in pool.items()}
    if not spec:
        return result
    nodes = parse_node_specs(spec, flag)
    _check_known(nodes, pool, flag)
    if include:
        result = {host: list(nodes[host] or pool[host]) for host in pool if host in nodes}
    else:
        for host, slots in nodes.items():
            result[host] = [s for s in result[host] if slots and s not in slots]
    result = {host: slots for host, slots in result.items() if slots}
    if not result:
        raise LaunchError(f"{flag} {spec!r} leaves no host to run on: keep at least one slot")
    return result
