"""The collectives one training step issues, per pipeline stage.

One step of a Megatron-style job (sequence parallel on, GPipe-ordered microbatches, which
is a valid global order of every rank's calls): per layer, the tensor-parallel
all-gather / reduce-scatter pairs of attention and MLP, the expert all-to-alls, the
context-parallel all-gather of keys/values; activations and gradients sent between
pipeline stages with group-local peers (``nccl:send 0->1`` / ``nccl:recv 1<-0``); the
data-parallel gradient all-reduce per bucket (or one ``allreduce_coalesced``); one small
all-reduce on the default group (the loss / grad-norm check).

The schedule is a list of global *phases*; a stage's program is the phases its ranks take
part in, in order. Every rank of a stage runs the same program, so sequence ids, op ids and
positions are computed once per stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .layout import Layout

# roles of a rank in a phase
COLL, SEND, RECV = 0, 1, 2

_TORCH = "/usr/local/lib/python3.10/dist-packages/torch"
_MEGATRON = "/workspace/Megatron-LM/megatron"


def _frame(name: str, filename: str, line: int) -> dict[str, object]:
    return {"name": name, "filename": filename, "line": line}


_C10D = f"{_TORCH}/distributed/distributed_c10d.py"
_LOGGER = _frame("wrapper", f"{_TORCH}/distributed/c10d_logger.py", 83)
_TRAIN = [
    _frame("train_step", f"{_MEGATRON}/training/training.py", 1120),
    _frame("train", f"{_MEGATRON}/training/training.py", 1672),
    _frame("pretrain", f"{_MEGATRON}/training/training.py", 386),
    _frame("<module>", "/workspace/Megatron-LM/pretrain_gpt.py", 284),
]

# call site -> stack frames, innermost first (as PyTorch dumps them)
CALL_SITES: dict[str, list[dict[str, object]]] = {
    "tp_all_gather": [
        _frame("all_gather_into_tensor", _C10D, 4476),
        _LOGGER,
        _frame("_gather_along_first_dim", f"{_MEGATRON}/core/tensor_parallel/mappings.py", 93),
        _frame("forward", f"{_MEGATRON}/core/tensor_parallel/mappings.py", 236),
        _frame("forward", f"{_MEGATRON}/core/tensor_parallel/layers.py", 918),
        _frame("forward_step", f"{_MEGATRON}/core/pipeline_parallel/schedules.py", 275),
        *_TRAIN,
    ],
    "tp_reduce_scatter": [
        _frame("reduce_scatter_tensor", _C10D, 5017),
        _LOGGER,
        _frame(
            "_reduce_scatter_along_first_dim", f"{_MEGATRON}/core/tensor_parallel/mappings.py", 126
        ),
        _frame("forward", f"{_MEGATRON}/core/tensor_parallel/mappings.py", 263),
        _frame("forward", f"{_MEGATRON}/core/tensor_parallel/layers.py", 1106),
        _frame("forward_step", f"{_MEGATRON}/core/pipeline_parallel/schedules.py", 275),
        *_TRAIN,
    ],
    "tp_bwd_all_gather": [
        _frame("all_gather_into_tensor", _C10D, 4476),
        _LOGGER,
        _frame("_gather_along_first_dim", f"{_MEGATRON}/core/tensor_parallel/mappings.py", 93),
        _frame("backward", f"{_MEGATRON}/core/tensor_parallel/mappings.py", 270),
        _frame("backward_step", f"{_MEGATRON}/core/pipeline_parallel/schedules.py", 366),
        *_TRAIN,
    ],
    "tp_bwd_reduce_scatter": [
        _frame("reduce_scatter_tensor", _C10D, 5017),
        _LOGGER,
        _frame(
            "_reduce_scatter_along_first_dim", f"{_MEGATRON}/core/tensor_parallel/mappings.py", 126
        ),
        _frame("backward", f"{_MEGATRON}/core/tensor_parallel/mappings.py", 243),
        _frame("backward_step", f"{_MEGATRON}/core/pipeline_parallel/schedules.py", 366),
        *_TRAIN,
    ],
    "ep_all_to_all": [
        _frame("all_to_all_single", _C10D, 5131),
        _LOGGER,
        _frame("forward", f"{_MEGATRON}/core/tensor_parallel/mappings.py", 465),
        _frame("token_permutation", f"{_MEGATRON}/core/transformer/moe/token_dispatcher.py", 538),
        _frame("forward", f"{_MEGATRON}/core/transformer/moe/moe_layer.py", 152),
        _frame("forward_step", f"{_MEGATRON}/core/pipeline_parallel/schedules.py", 275),
        *_TRAIN,
    ],
    "ep_bwd_all_to_all": [
        _frame("all_to_all_single", _C10D, 5131),
        _LOGGER,
        _frame("backward", f"{_MEGATRON}/core/tensor_parallel/mappings.py", 476),
        _frame("backward_step", f"{_MEGATRON}/core/pipeline_parallel/schedules.py", 366),
        *_TRAIN,
    ],
    "cp_all_gather": [
        _frame("all_gather_into_tensor", _C10D, 4476),
        _LOGGER,
        _frame("forward", f"{_MEGATRON}/core/transformer/dot_product_attention.py", 148),
        _frame("forward", f"{_MEGATRON}/core/transformer/attention.py", 660),
        _frame("forward_step", f"{_MEGATRON}/core/pipeline_parallel/schedules.py", 275),
        *_TRAIN,
    ],
    "cp_bwd_reduce_scatter": [
        _frame("reduce_scatter_tensor", _C10D, 5017),
        _LOGGER,
        _frame("backward", f"{_MEGATRON}/core/transformer/dot_product_attention.py", 201),
        _frame("backward_step", f"{_MEGATRON}/core/pipeline_parallel/schedules.py", 366),
        *_TRAIN,
    ],
    "pp_send_forward": [
        _frame("isend", _C10D, 2652),
        _frame("send", _C10D, 2751),
        _LOGGER,
        _frame("_p2p_ops", f"{_MEGATRON}/core/pipeline_parallel/p2p_communication.py", 214),
        _frame("send_forward", f"{_MEGATRON}/core/pipeline_parallel/p2p_communication.py", 480),
        _frame(
            "forward_backward_pipelining_without_interleaving",
            f"{_MEGATRON}/core/pipeline_parallel/schedules.py",
            1816,
        ),
        *_TRAIN,
    ],
    "pp_recv_forward": [
        _frame("irecv", _C10D, 2709),
        _frame("recv", _C10D, 2796),
        _LOGGER,
        _frame("_p2p_ops", f"{_MEGATRON}/core/pipeline_parallel/p2p_communication.py", 229),
        _frame("recv_forward", f"{_MEGATRON}/core/pipeline_parallel/p2p_communication.py", 437),
        _frame(
            "forward_backward_pipelining_without_interleaving",
            f"{_MEGATRON}/core/pipeline_parallel/schedules.py",
            1811,
        ),
        *_TRAIN,
    ],
    "pp_send_backward": [
        _frame("isend", _C10D, 2652),
        _frame("send", _C10D, 2751),
        _LOGGER,
        _frame("_p2p_ops", f"{_MEGATRON}/core/pipeline_parallel/p2p_communication.py", 214),
        _frame("send_backward", f"{_MEGATRON}/core/pipeline_parallel/p2p_communication.py", 501),
        _frame(
            "forward_backward_pipelining_without_interleaving",
            f"{_MEGATRON}/core/pipeline_parallel/schedules.py",
            1901,
        ),
        *_TRAIN,
    ],
    "pp_recv_backward": [
        _frame("irecv", _C10D, 2709),
        _frame("recv", _C10D, 2796),
        _LOGGER,
        _frame("_p2p_ops", f"{_MEGATRON}/core/pipeline_parallel/p2p_communication.py", 229),
        _frame("recv_backward", f"{_MEGATRON}/core/pipeline_parallel/p2p_communication.py", 458),
        _frame(
            "forward_backward_pipelining_without_interleaving",
            f"{_MEGATRON}/core/pipeline_parallel/schedules.py",
            1895,
        ),
        *_TRAIN,
    ],
    "dp_all_reduce": [
        _frame("all_reduce", _C10D, 3245),
        _LOGGER,
        _frame("start_grad_sync", f"{_MEGATRON}/core/distributed/param_and_grad_buffer.py", 412),
        _frame(
            "finish_grad_sync", f"{_MEGATRON}/core/distributed/distributed_data_parallel.py", 447
        ),
        *_TRAIN,
    ],
    "dp_all_reduce_coalesced": [
        _frame("all_reduce_coalesced", _C10D, 3325),
        _LOGGER,
        _frame("start_grad_sync", f"{_MEGATRON}/core/distributed/param_and_grad_buffer.py", 405),
        _frame(
            "finish_grad_sync", f"{_MEGATRON}/core/distributed/distributed_data_parallel.py", 447
        ),
        *_TRAIN,
    ],
    "world_all_reduce": [
        _frame("all_reduce", _C10D, 3245),
        _LOGGER,
        _frame("check_for_nan_in_loss", f"{_MEGATRON}/training/utils.py", 306),
        _frame("train_step", f"{_MEGATRON}/training/training.py", 1138),
        *_TRAIN[1:],
    ],
    "init_barrier": [
        _frame("barrier", _C10D, 5349),
        _LOGGER,
        _frame("_initialize_distributed", f"{_MEGATRON}/training/initialize.py", 311),
        _frame("initialize_megatron", f"{_MEGATRON}/training/initialize.py", 87),
        *_TRAIN[2:],
    ],
    # a rank-dependent branch in user code: where injected mismatches come from
    "user_branch": [
        _frame("all_reduce", _C10D, 3245),
        _LOGGER,
        _frame("sync_aux_stats", "/workspace/train/callbacks/aux_stats.py", 57),
        _frame("on_micro_batch_end", "/workspace/train/callbacks/aux_stats.py", 31),
        *_TRAIN,
    ],
}

# spacing before a phase starts and the time its kernel takes once every member is there (ms)
_TIMING_MS = {
    "tp": (1.6, 0.4),
    "cp": (1.2, 0.5),
    "ep": (2.0, 0.9),
    "pp": (0.8, 0.3),
    "dp": (6.0, 12.0),
    "world": (2.0, 0.05),
}


@dataclass(frozen=True)
class Phase:
    """One collective (or one send/recv pair) of the global schedule."""

    kind: str  # group kind the op runs on
    op: str  # backend-neutral op name (``_all_gather_base``, ``all_reduce``, ``send``)
    input_sizes: tuple[tuple[int, ...], ...]
    output_sizes: tuple[tuple[int, ...], ...]
    dtype: str
    site: str  # key of CALL_SITES (the sender's site for a P2P phase)
    recv_site: str = ""
    src_stage: int = -1  # P2P: sending stage
    dst_stage: int = -1  # P2P: receiving stage
    offset_ns: int = 0  # nominal start of the phase after the step starts
    duration_ns: int = 0
    # MoE token exchange (all_to_all): "dispatch" sends every rank's routed tokens (the same
    # count on every rank) and receives what the router sent to its experts (a different
    # count per rank); "combine" sends those back. A healthy step's sizes differ per rank.
    split: str = ""

    @property
    def is_p2p(self) -> bool:
        return self.src_stage >= 0


@dataclass
class ModelShape:
    """The knobs that decide how many collectives a step issues and their sizes."""

    layers: int = 2  # transformer layers per pipeline stage
    microbatches: int = 4
    seq_len: int = 4096
    micro_batch: int = 1
    hidden: int = 4096
    buckets: int = 4  # data-parallel gradient buckets
    dp_coalesced: bool = False  # reduce the buckets with one allreduce_coalesced
    dtype: str = "BFloat16"


@dataclass
class StageProgram:
    """What every rank of one pipeline stage calls in one step, in order.

    Parallel lists, one item per call: the phase index, the rank's role in it, and the
    1-based index of the call among this stage's calls of that group kind in the step
    (the per-group sequence counter's increment)."""

    phases: list[int] = field(default_factory=list)
    roles: list[int] = field(default_factory=list)
    # per kind: number of collectives / P2P ops this stage issues per step
    n_coll: dict[str, int] = field(default_factory=dict)
    n_p2p: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.phases)


@dataclass
class Schedule:
    layout: Layout
    shape: ModelShape
    phases: list[Phase]
    programs: list[StageProgram]  # one per pipeline stage
    step_ns: int

    def program(self, stage: int) -> StageProgram:
        return self.programs[stage]


def build_schedule(layout: Layout, shape: ModelShape | None = None) -> Schedule:
    """The global phase list of one step and each stage's program."""
    shape = shape or ModelShape()
    L, M = shape.layers, shape.microbatches
    tp, cp, ep, dp, pp = layout.tp, layout.cp, layout.ep, layout.dp, layout.pp
    b, h = shape.micro_batch, shape.hidden
    s_local = max(1, shape.seq_len // cp)  # this rank's sequence after context parallelism
    s_shard = max(1, s_local // tp)  # sequence-parallel shard
    dt = shape.dtype
    phases: list[Phase] = []

    def coll(
        kind: str, op: str, ins: tuple, outs: tuple, site: str, dtype: str = dt, split: str = ""
    ) -> None:
        if layout.size(kind) > 1:
            phases.append(Phase(kind, op, ins, outs, dtype, site, split=split))

    def layer_forward() -> None:
        if cp > 1:
            kv = (2 * s_local, b, h // max(1, tp))
            coll("cp", "_all_gather_base", (kv,), ((kv[0] * cp, b, kv[2]),), "cp_all_gather")
        coll("tp", "_all_gather_base", ((s_shard, b, h),), ((s_shard * tp, b, h),), "tp_all_gather")
        coll(
            "tp",
            "_reduce_scatter_base",
            ((s_shard * tp, b, h),),
            ((s_shard, b, h),),
            "tp_reduce_scatter",
        )
        if ep > 1:
            tokens = (s_shard * b * 2, h)  # top-2 routing (per-rank splits: see faults.py)
            coll("ep", "all_to_all", (tokens,), (tokens,), "ep_all_to_all", split="dispatch")
            coll("ep", "all_to_all", (tokens,), (tokens,), "ep_all_to_all", split="combine")
        coll("tp", "_all_gather_base", ((s_shard, b, h),), ((s_shard * tp, b, h),), "tp_all_gather")
        coll(
            "tp",
            "_reduce_scatter_base",
            ((s_shard * tp, b, h),),
            ((s_shard, b, h),),
            "tp_reduce_scatter",
        )

    def layer_backward() -> None:
        coll(
            "tp",
            "_all_gather_base",
            ((s_shard, b, h),),
            ((s_shard * tp, b, h),),
            "tp_bwd_all_gather",
        )
        coll(
            "tp",
            "_reduce_scatter_base",
            ((s_shard * tp, b, h),),
            ((s_shard, b, h),),
            "tp_bwd_reduce_scatter",
        )
        if ep > 1:
            tokens = (s_shard * b * 2, h)  # gradients retrace the tokens: combine, dispatch
            coll("ep", "all_to_all", (tokens,), (tokens,), "ep_bwd_all_to_all", split="dispatch")
            coll("ep", "all_to_all", (tokens,), (tokens,), "ep_bwd_all_to_all", split="combine")
        coll(
            "tp",
            "_all_gather_base",
            ((s_shard, b, h),),
            ((s_shard * tp, b, h),),
            "tp_bwd_all_gather",
        )
        coll(
            "tp",
            "_reduce_scatter_base",
            ((s_shard * tp, b, h),),
            ((s_shard, b, h),),
            "tp_bwd_reduce_scatter",
        )
        if cp > 1:
            kv = (2 * s_local, b, h // max(1, tp))
            coll(
                "cp",
                "_reduce_scatter_base",
                ((kv[0] * cp, b, kv[2]),),
                (kv,),
                "cp_bwd_reduce_scatter",
            )

    act = ((s_shard, b, h),)
    for _m in range(M):
        for s in range(pp):
            for _ in range(L):
                layer_forward()
            if s < pp - 1:
                phases.append(
                    Phase(
                        "pp", "send", act, act, dt, "pp_send_forward", "pp_recv_forward", s, s + 1
                    )
                )
    for _m in range(M):
        for s in reversed(range(pp)):
            for _ in range(L):
                layer_backward()
            if s > 0:
                phases.append(
                    Phase(
                        "pp", "send", act, act, dt, "pp_send_backward", "pp_recv_backward", s, s - 1
                    )
                )
    if dp > 1:
        # gradients of this rank's parameters, split into buckets
        params = max(1, (12 * h * h * L) // tp)
        per_bucket = max(1, params // max(1, shape.buckets))
        if shape.dp_coalesced:
            sizes = tuple((per_bucket,) for _ in range(shape.buckets))
            phases.append(
                Phase("dp", "allreduce_coalesced", sizes, sizes, "Float", "dp_all_reduce_coalesced")
            )
        else:
            for _ in range(shape.buckets):
                phases.append(
                    Phase(
                        "dp",
                        "all_reduce",
                        ((per_bucket,),),
                        ((per_bucket,),),
                        "Float",
                        "dp_all_reduce",
                    )
                )
    phases.append(Phase("world", "all_reduce", ((1,),), ((1,),), "Float", "world_all_reduce"))

    # nominal timing: phases run one after another within the step
    t = 0
    timed = []
    for ph in phases:
        gap_ms, dur_ms = _TIMING_MS[ph.kind]
        t += int(gap_ms * 1e6)
        timed.append(Phase(**{**ph.__dict__, "offset_ns": t, "duration_ns": int(dur_ms * 1e6)}))
        t += int(dur_ms * 1e6)
    step_ns = t + 20_000_000  # optimizer step, data loading

    programs = []
    for stage in range(pp):
        prog = StageProgram()
        for i, ph in enumerate(timed):
            if ph.is_p2p:
                if ph.src_stage == stage:
                    role = SEND
                elif ph.dst_stage == stage:
                    role = RECV
                else:
                    continue
                prog.n_p2p[ph.kind] = prog.n_p2p.get(ph.kind, 0) + 1
            else:
                role = COLL
                prog.n_coll[ph.kind] = prog.n_coll.get(ph.kind, 0) + 1
            prog.phases.append(i)
            prog.roles.append(role)
        programs.append(prog)
    return Schedule(layout, shape, timed, programs, step_ns)
