"""Op names and op kinds, the one place that says what an op *is*.

An op is named backend-neutrally (``all_reduce``, ``send``, ``_allgather_base``): the
profiling name with its engine prefix (``nccl:``, ``gloo:``, ``nccl2:``, ``c10d:``) removed.
"""

from __future__ import annotations

import enum


class OpKind(enum.Enum):
    """How an op is matched across ranks: collectives by the group's ``collective_seq_id``,
    point-to-point ops by (group, sender, receiver, ``p2p_seq_id``)."""

    COLLECTIVE = "collective"
    P2P = "p2p"


# Every name a point-to-point op is recorded under, by any recorder.
P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "sendrecv", "recv_anysource"})


def op_name(profiling_name: str | None) -> str:
    """Backend-neutral op name: ``nccl:all_reduce`` -> ``all_reduce``."""
    if not profiling_name:
        return ""
    return profiling_name.split(":", 1)[1] if ":" in profiling_name else profiling_name


def op_kind(op: str) -> OpKind:
    return OpKind.P2P if op in P2P_OPS else OpKind.COLLECTIVE
