"""Op names, op families and op semantics: the one place that says what an op *is*.

An op is named backend-neutrally (``all_reduce``, ``send``, ``_allgather_base``): the
profiling name with its engine prefix (``nccl:``, ``gloo:``, ``nccl2:``, ``c10d:``) removed.

``SEMANTICS`` says, per op family, which recorded attributes must agree on every member of
a collective and which may differ per rank (docs/op-semantics.md explains each row and where
frtools differs from PyTorch's own analyzer). ``FAMILY`` maps every name an op is recorded
under, by any recorder, to its family. Alignment and diagnosis read only these two tables:
a ``mismatch`` names only attributes that must agree.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class OpFamily(enum.Enum):
    """Ops that exchange data the same way: two members in one family at one seq are the
    same collective (``all_gather`` into a list and ``_allgather_base`` into one tensor
    interoperate); two families at one seq are an op mismatch."""

    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    GATHER = "gather"
    SCATTER = "scatter"
    BARRIER = "barrier"
    OBJECT = "object"  # all_gather_object, broadcast_object_list, ...: variable-size payloads
    COALESCED = "coalesced"  # a coalescing block (its parts say more; see align)
    P2P = "p2p"
    MANAGEMENT = "management"  # split, new_window: no payload
    UNKNOWN = "unknown"


# Attributes compared across members (columns of the aligned entries).
OP = "op"
INPUT_SIZES = "input_sizes"
OUTPUT_SIZES = "output_sizes"
INPUT_DTYPES = "input_dtypes"
OUTPUT_DTYPES = "output_dtypes"
ATTRIBUTES = (OP, INPUT_SIZES, OUTPUT_SIZES, INPUT_DTYPES, OUTPUT_DTYPES)
_ALL = frozenset(ATTRIBUTES)


@dataclass(frozen=True)
class OpSemantics:
    """What must agree across the members of one op of this family, and why the rest may
    differ. ``op`` always agrees (compared by family)."""

    family: OpFamily
    must_agree: frozenset[str]
    may_differ: str  # why the attributes not in ``must_agree`` may differ per rank
    rooted: bool = False  # the root (src/dst) must agree too; no recorder stores it yet
    size_relation: str = ""  # how a member's own input and output relate

    def checks(self, attribute: str) -> bool:
        return attribute in self.must_agree


SEMANTICS: dict[OpFamily, OpSemantics] = {
    OpFamily.ALL_REDUCE: OpSemantics(
        OpFamily.ALL_REDUCE,
        _ALL,
        "nothing: every member reduces the same shape and dtype",
        size_relation="output = input",
    ),
    OpFamily.BROADCAST: OpSemantics(
        OpFamily.BROADCAST,
        _ALL,
        "nothing: the root's buffer is copied into same-sized buffers",
        rooted=True,
        size_relation="output = input",
    ),
    OpFamily.REDUCE: OpSemantics(
        OpFamily.REDUCE,
        _ALL,
        "nothing: like all_reduce, the result lands on the root only",
        rooted=True,
        size_relation="output = input",
    ),
    OpFamily.ALL_GATHER: OpSemantics(
        OpFamily.ALL_GATHER,
        _ALL,
        "nothing: every member contributes the same shape",
        size_relation="output = group size x input",
    ),
    OpFamily.REDUCE_SCATTER: OpSemantics(
        OpFamily.REDUCE_SCATTER,
        _ALL,
        "nothing: every member reduces the same full input",
        size_relation="input = group size x output",
    ),
    OpFamily.ALL_TO_ALL: OpSemantics(
        OpFamily.ALL_TO_ALL,
        frozenset({OP, INPUT_DTYPES, OUTPUT_DTYPES}),
        "sizes: split sizes are per rank (MoE token dispatch sends a different number of "
        "tokens to each expert); only the whole group's totals must balance",
        size_relation="sum of inputs over members = sum of outputs over members",
    ),
    OpFamily.GATHER: OpSemantics(
        OpFamily.GATHER,
        frozenset({OP, INPUT_SIZES, INPUT_DTYPES}),
        "outputs: only the root receives (group size x input)",
        rooted=True,
        size_relation="root output = group size x input",
    ),
    OpFamily.SCATTER: OpSemantics(
        OpFamily.SCATTER,
        frozenset({OP, OUTPUT_SIZES, OUTPUT_DTYPES}),
        "inputs: only the root sends (group size x output)",
        rooted=True,
        size_relation="root input = group size x output",
    ),
    OpFamily.BARRIER: OpSemantics(OpFamily.BARRIER, frozenset({OP}), "no payload"),
    OpFamily.OBJECT: OpSemantics(
        OpFamily.OBJECT,
        frozenset({OP}),
        "sizes and dtypes: pickled objects of any length (byte tensors sized per rank)",
    ),
    OpFamily.COALESCED: OpSemantics(
        OpFamily.COALESCED,
        frozenset({OP}),
        "whatever its parts allow: a block agrees where every part's family requires it",
    ),
    OpFamily.P2P: OpSemantics(
        OpFamily.P2P,
        frozenset({INPUT_SIZES, INPUT_DTYPES}),
        "compared per pair only: the k-th send r->p must match the k-th recv at p from r",
        size_relation="send size = matching recv size",
    ),
    OpFamily.MANAGEMENT: OpSemantics(OpFamily.MANAGEMENT, frozenset({OP}), "no payload"),
    OpFamily.UNKNOWN: OpSemantics(
        OpFamily.UNKNOWN,
        frozenset({OP}),
        "unknown op: only the name is compared (no false mismatch on an op frtools does not know)",
    ),
}

# Every name an op is recorded under (prefix removed): PyTorch FR on NCCL and Gloo (all
# versions), the c10d op names torch 2.15's process-group hooks report (nccl2:/c10d:), and
# frtools' own recorder (frtools/recorder/capture.py OP_NAMES).
FAMILY: dict[str, OpFamily] = {
    # all_reduce; Gloo's FR records reduce_scatter_tensor / reduce_scatter_single as
    # all_reduce (it runs one), with input = output = the full input
    "all_reduce": OpFamily.ALL_REDUCE,
    "allreduce": OpFamily.ALL_REDUCE,
    "all_reduce_barrier": OpFamily.ALL_REDUCE,
    "allreduce_coalesced": OpFamily.ALL_REDUCE,
    "all_reduce_coalesced": OpFamily.ALL_REDUCE,
    "allreduce_sparse": OpFamily.ALL_REDUCE,
    "broadcast": OpFamily.BROADCAST,
    "_broadcast_oop": OpFamily.BROADCAST,
    "broadcast_coalesced": OpFamily.BROADCAST,
    "reduce": OpFamily.REDUCE,
    "_reduce_oop": OpFamily.REDUCE,
    "all_gather": OpFamily.ALL_GATHER,
    "allgather": OpFamily.ALL_GATHER,
    "all_gather_into_tensor": OpFamily.ALL_GATHER,
    "all_gather_single": OpFamily.ALL_GATHER,
    "_all_gather_base": OpFamily.ALL_GATHER,
    "_allgather_base": OpFamily.ALL_GATHER,
    "all_gather_v": OpFamily.ALL_GATHER,
    "all_gather_coalesced": OpFamily.ALL_GATHER,
    "allgather_coalesced": OpFamily.ALL_GATHER,
    "all_gather_into_tensor_coalesced": OpFamily.ALL_GATHER,
    "allgather_into_tensor_coalesced": OpFamily.ALL_GATHER,
    "ALLGATHER_coalesced": OpFamily.ALL_GATHER,
    "reduce_scatter": OpFamily.REDUCE_SCATTER,
    "reduce_scatter_tensor": OpFamily.REDUCE_SCATTER,
    "reduce_scatter_single": OpFamily.REDUCE_SCATTER,
    "_reduce_scatter_base": OpFamily.REDUCE_SCATTER,
    "reduce_scatter_v": OpFamily.REDUCE_SCATTER,
    "reduce_scatter_tensor_coalesced": OpFamily.REDUCE_SCATTER,
    "REDUCE_SCATTER_coalesced": OpFamily.REDUCE_SCATTER,
    "all_to_all": OpFamily.ALL_TO_ALL,
    "all_to_all_single": OpFamily.ALL_TO_ALL,
    "all_to_all_v_single": OpFamily.ALL_TO_ALL,
    "alltoall": OpFamily.ALL_TO_ALL,
    "alltoall_base": OpFamily.ALL_TO_ALL,
    "gather": OpFamily.GATHER,
    "scatter": OpFamily.SCATTER,
    "barrier": OpFamily.BARRIER,
    "monitored_barrier": OpFamily.BARRIER,
    "all_gather_object": OpFamily.OBJECT,
    "broadcast_object_list": OpFamily.OBJECT,
    "gather_object": OpFamily.OBJECT,
    "scatter_object_list": OpFamily.OBJECT,
    "send_object_list": OpFamily.OBJECT,
    "recv_object_list": OpFamily.OBJECT,
    "coalesced": OpFamily.COALESCED,
    "batch_isend_irecv": OpFamily.COALESCED,
    "send": OpFamily.P2P,
    "recv": OpFamily.P2P,
    "isend": OpFamily.P2P,
    "irecv": OpFamily.P2P,
    "sendrecv": OpFamily.P2P,
    "recv_anysource": OpFamily.P2P,
    "split": OpFamily.MANAGEMENT,
    "new_window": OpFamily.MANAGEMENT,
}

# Every name a point-to-point op is recorded under, by any recorder.
P2P_OPS = frozenset(name for name, family in FAMILY.items() if family is OpFamily.P2P)


def op_name(profiling_name: str | None) -> str:
    """Backend-neutral op name: ``nccl:all_reduce`` -> ``all_reduce``."""
    if not profiling_name:
        return ""
    return profiling_name.split(":", 1)[1] if ":" in profiling_name else profiling_name


def family_of(op: str | None) -> OpFamily:
    """The family of a recorded op name (with or without its engine prefix)."""
    if not op:
        return OpFamily.UNKNOWN
    name = op_name(op).split(" ", 1)[0]  # "send 0->1": PyTorch FR's P2P profiling names
    return FAMILY.get(name, OpFamily.UNKNOWN)


def semantics(op: str | None) -> OpSemantics:
    return SEMANTICS[family_of(op)]


def parts_must_agree(parts: str) -> frozenset[str]:
    """What must agree for a unit whose parts are ``parts`` (op names joined with ``;``,
    as align joins a coalescing block): what every part's family requires. A block that
    mixes P2P or all_to_all parts agrees only on its op."""
    families = [family_of(p) for p in parts.split(";") if p]
    # the block's trailing ``coalesced`` entry is its marker, not a part
    families = [f for f in families if f is not OpFamily.COALESCED]
    if not families:
        return frozenset({OP})
    agreed = _ALL
    for family in families:
        # P2P parts pair with their peers, not with the group: sizes differ per rank
        part = frozenset({OP}) if family is OpFamily.P2P else SEMANTICS[family].must_agree
        agreed = agreed & part
    return agreed | {OP}
