"""The master port of a run on this machine: DeepSpeed's default unless it is taken here."""
from __future__ import annotations

import socket
from dataclasses import replace
from typing import Optional

from .plan import LaunchPlan


def port_in_use(port: int) -> bool:
    """Whether a listener holds `port` here, on any address (torch's store listens on all)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no owner
        try:
            sock.bind(("", port))
        except OSError:
            return True
    return False


def free_port() -> int:
    """A port nobody listens on now (the system's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def runs_here_alone(plan: LaunchPlan) -> bool:
    """One node, on this machine: no other node has to be told the port."""
    return len(plan.nodes) == 1 and (plan.local_node == 0 or plan.nodes[0].host == "localhost")


def with_free_master_port(plan: LaunchPlan, port_given: Optional[int]) -> LaunchPlan:
    """The plan, on a free port (and a note saying which) when the default one is taken and
    the job runs on this machine alone; a port the user gave is kept as it is."""
    if port_given is not None or not runs_here_alone(plan) or \
            not port_in_use(plan.master_port):
        return plan
    port = free_port()
    note = (f"master port {plan.master_port} is in use on this machine: using the free port "
            f"{port} (--master_port P chooses one)")
    return replace(plan, master_port=port, notes=plan.notes + (note,))
