"""Training-shaped torch.distributed jobs on Gloo with one injectable fault: the real-job corpus.

Launched like torchrun launches a worker (env RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT); ``tests/corpus/harness.py`` does that, one process per rank. Shapes
(``--shape``):

* ``ddp``        DistributedDataParallel over a small MLP (the reducer's bucket all-reduces,
                 issued from C++), plus the usual logging all_reduce of the loss.
* ``fsdp2``      ``torch.distributed.fsdp.fully_shard`` (FSDP2) over a small MLP: per-layer
                 all-gathers of parameters, reduce-scatters of gradients; logging all_reduce.
* ``moe``        8 ranks, expert-parallel groups [0-3], [4-7] and data-parallel groups
                 [i, i+4]: sequence-parallel all_gather_into_tensor, the token counts
                 exchanged by an all_to_all_single, the token dispatch all_to_all_single with
                 UNEVEN split sizes (each rank routes a different number of tokens to each
                 expert), the combine all_to_all_single back, reduce_scatter_tensor,
                 data-parallel all_reduce of the expert gradients, world all_reduce of the
                 auxiliary-loss statistics.
* ``pipeline``   one stage per rank: forward activations by send/recv, backward gradients by
                 batch_isend_irecv, then world all_reduces of the gradient norm and the loss.
* ``multigroup`` tensor-parallel pairs, data-parallel groups and the world group, as
                 ``examples/faulty_job.py``.
* ``pp1f1b``     ``torch.distributed.pipelining``: a ``PipelineStage`` per rank driven by
                 ``Schedule1F1B`` (4 micro-batches), then the loss broadcast from the last stage.
* ``fsdp2dcp``   FSDP2 saving with ``torch.distributed.checkpoint.save`` every 3 steps (and at
                 the last); ``--fault write-error``: the fault rank's write fails (ENOSPC).
* ``tiny300``    tiny collectives (1-element all_reduce; broadcast and all_gather every 10th
                 step), a final barrier, the Flight Recorder dump right after it.

Faults (``--fault``) strike rank ``--fault-rank`` at step ``--fault-step`` (1-based):

* ``compute``   hangs in user code (``time.sleep``) before the step's first collective (the
                stopping faults strike there; ``--fault-at reduce``, pipeline only: after the
                step's send/recv, before its world all-reduces);
* ``gil``       a C call that never returns nor releases the GIL (``ctypes.PyDLL``);
* ``sigkill``   ``os.kill(getpid(), SIGKILL)``;  ``segfault``: ``faulthandler._sigsegv()``;
* ``exception`` raises ``RuntimeError("CUDA error: an illegal memory access ...")``, uncaught;
* ``exit``      ``os._exit(1)`` (its sockets close with it: Gloo fails its peers' next op);
* ``skip``      skips one collective and goes on;
* ``size`` / ``dtype`` a wrong-sized / wrong-dtype tensor in one collective;
* ``op``        a different collective at the same point;
* ``order``     issues two collectives of different groups in the other order (a deadlock);
* ``straggler`` sleeps ``--straggle-ms`` before every collective (the job completes);
* ``write-error`` (fsdp2dcp) the checkpoint write fails with ``OSError(ENOSPC)``;
* ``never-init`` the fault rank never calls ``init_process_group`` (stuck in its set-up: a
                data-loading loop that never ends); the others wait inside it.

Every rank touches ``--heartbeat-dir``'s ``rank_<R>.up`` just before ``init_process_group``
(the fault rank of ``never-init`` where it stops instead): the harness sees a job stuck in
start-up from outside.

Recording. With ``--fr-dir DIR`` the job behaves like a user's script with PyTorch's own Flight
Recorder: each rank writes ``DIR/rank_<R>.pkl`` (``_dump_fr_trace()``) at the end of a healthy
run, when a collective raises, or from a watchdog thread when its main thread made no progress
for ``--hang-seconds``. A rank that is killed, exits, segfaults or holds the GIL writes nothing,
as in real life. The watchdog does not end the process (the launcher tears a hung job down);
an error is re-raised after the dump. Without ``--fr-dir`` the job writes no dump of its own:
run it under ``frtools run`` and collect with ``frtools dump``.

``--heartbeat-dir DIR``: the main thread touches ``DIR/rank_<R>.hb`` as it makes progress, so
the harness sees a hang from outside (a rank holding the GIL cannot say so itself).
"""

from __future__ import annotations

import os

# PyTorch's Flight Recorder reads its buffer size when the first group is created.
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

SHAPES = ("ddp", "fsdp2", "moe", "pipeline", "multigroup", "pp1f1b", "fsdp2dcp", "tiny300")
FAULTS = (
    "none",
    "compute",
    "gil",
    "sigkill",
    "segfault",
    "exception",
    "exit",
    "skip",
    "size",
    "dtype",
    "op",
    "order",
    "straggler",
    "write-error",
    "never-init",
)
# Faults that stop the rank where it stands (before the step's first collective).
STOPS = ("compute", "gil", "sigkill", "segfault", "exception", "exit")
# Which collective-level faults each shape implements.
SHAPE_FAULTS = {
    "ddp": ("size", "dtype", "op"),
    "fsdp2": ("size", "dtype", "op"),
    "moe": ("skip", "size", "dtype", "op", "order"),
    "pipeline": ("skip", "op"),
    "multigroup": ("skip", "size", "dtype", "op", "order"),
    "fsdp2dcp": ("write-error",),
}

# torch 2.13 deprecates reduce_scatter_tensor in favour of reduce_scatter_single.
reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

PP_MICROBATCHES = 4  # pp1f1b: micro-batches per schedule step
DCP_EVERY = 3  # fsdp2dcp: a checkpoint every this many steps (and at the last)


class Runtime:
    """What every shape shares: the fault switch, the heartbeat, the Flight Recorder dumps."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.step = 0
        self.faulty = self.rank == args.fault_rank
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self._dumped_idle = False  # the watchdog dumped since the last progress
        self.armed = False  # hangs are judged during the training steps, not the set-up
        self._touched = 0.0
        self.dumped_at_end = False  # the shape wrote its end-of-run dump itself
        self.hb = Path(args.heartbeat_dir) / f"rank_{self.rank}.hb" if args.heartbeat_dir else None

    def arm(self) -> None:
        """Training starts: from now on no progress means a hang, for the watchdog and (the
        heartbeat file appears) for the harness. Set-up (imports, rendezvous, groups, the
        first Flight Recorder dump's imports) can take many seconds on a loaded machine."""
        if self.armed:
            return
        self.armed = True
        self.beat()
        if self.hb is not None:
            self.hb.parent.mkdir(parents=True, exist_ok=True)
            self.hb.touch()

    # -- progress ----------------------------------------------------------------------------
    def beat(self) -> None:
        now = time.monotonic()
        self._last = now
        self._dumped_idle = False
        if self.hb is not None and now - self._touched > 0.1:
            self._touched = now
            with contextlib.suppress(OSError):
                os.utime(self.hb)

    def done(self) -> None:
        """The training loop is over (finished or raised): what follows is teardown, which
        may take seconds on a loaded machine without being a hang."""
        if self.hb is not None:
            with contextlib.suppress(OSError):
                self.hb.with_suffix(".done").touch()

    def idle(self) -> float:
        return time.monotonic() - self._last

    # -- faults ------------------------------------------------------------------------------
    def now(self, fault: str) -> bool:
        """This rank injects ``fault`` at this step."""
        return self.faulty and self.args.fault == fault and self.step == self.args.fault_step

    @contextlib.contextmanager
    def coll(self) -> Iterator[None]:
        """Around one collective (or a region that issues collectives: DDP's backward).
        A context manager, not a wrapper, so the recorded call site is the caller's line."""
        if self.faulty and self.args.fault == "straggler":
            time.sleep(self.args.straggle_ms / 1000)
        self.beat()
        yield
        self.beat()

    def steps(self) -> Iterator[int]:
        """The training loop's steps, 1-based; the stop faults strike at the start of one."""
        self.arm()
        for step in range(1, self.args.steps + 1):
            self.step = step
            self.stop_point()
            yield self.step

    def stop_point(self, where: str = "step") -> None:
        """The faults that stop a rank where it stands: at the start of the fault step, or
        (``--fault-at reduce``, pipeline) after the step's P2P, before its all-reduces."""
        self.beat()
        if where != self.args.fault_at or not (self.faulty and self.step == self.args.fault_step):
            return
        fault = self.args.fault
        if fault not in STOPS:
            return
        print(f"rank {self.rank}: injecting {fault} at step {self.step}", file=sys.stderr)
        sys.stderr.flush()
        if fault == "compute":
            self.beat()
            while True:  # "stuck in compute": a data-dependent loop that never ends
                time.sleep(1.0)
        if fault == "gil":
            hold_gil_forever()
        if fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "segfault":
            import faulthandler

            faulthandler._sigsegv()
        if fault == "exception":
            raise RuntimeError(
                "CUDA error: an illegal memory access was encountered\n"
                "CUDA kernel errors might be asynchronously reported at some other API call"
            )
        if fault == "exit":
            os._exit(1)

    # -- PyTorch Flight Recorder dumps -------------------------------------------------------
    def dump(self, why: str) -> None:
        """Write this rank's Flight Recorder dump (atomically: a killed writer leaves a
        ``.tmp``, never a half dump under the final name). A later dump replaces an earlier
        one: a watchdog dump of a slow moment is superseded by the end-of-run dump."""
        out = self.args.fr_dir
        if out is None:
            return
        with self._lock:
            data = torch._C._distributed_c10d._dump_fr_trace()
            out = Path(out)
            tmp = out / f".rank_{self.rank}.pkl.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, out / f"rank_{self.rank}.pkl")
        print(f"rank {self.rank}: {why}; flight recorder dump written", file=sys.stderr)
        sys.stderr.flush()

    def start_watchdog(self) -> None:
        """Dump when the main thread has made no progress for --hang-seconds (it is blocked
        in a collective, or in compute). The process is left as it is."""
        if self.args.fr_dir is None:
            return

        def watch() -> None:
            while True:
                time.sleep(0.1)
                if self.armed and not self._dumped_idle and self.idle() > self.args.hang_seconds:
                    self._dumped_idle = True
                    self.dump(f"no progress for {self.args.hang_seconds:g}s")

        threading.Thread(target=watch, name="fr-watchdog", daemon=True).start()


def never_init(rt: Runtime) -> None:
    """Set-up is over (``rank_<R>.up``); the ``never-init`` fault rank hangs here, before
    ``init_process_group``, in user code that never ends."""
    if rt.hb is not None:
        rt.hb.parent.mkdir(parents=True, exist_ok=True)
        rt.hb.with_suffix(".up").touch()
    if rt.faulty and rt.args.fault == "never-init":
        print(f"rank {rt.rank}: injecting never-init", file=sys.stderr)
        sys.stderr.flush()
        while True:  # "still loading the data set"
            time.sleep(1.0)


def hold_gil_forever() -> None:
    """A C call that never returns and never releases the GIL (``ctypes.PyDLL`` keeps it):
    relocking a plain pthread mutex. Not ``sleep``: a signal (the harness's or frtools'
    stack request) ends a sleep early, and the rank would go on training."""
    import ctypes

    libc = ctypes.PyDLL(None)
    mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)  # a normal mutex: blocks forever, restarted after signals


def is_collective_error(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return any(w in text for w in ("gloo", "connection closed", "connection reset", "timed out"))


# -- shapes ------------------------------------------------------------------------------------


def mlp(width: int = 64) -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 8)
    )


def log_metrics(rt: Runtime, loss: torch.Tensor, out: torch.Tensor) -> None:
    """The logging all_reduce most training loops do every step: the loss and a histogram of
    the predictions, averaged over the ranks. The collective-level faults of ddp and fsdp2
    strike here: a rank built its histogram with another bin count (``size``) or in float64
    (``dtype``), or broadcasts where the others all-reduce (``op``)."""
    bins = 768 if rt.now("size") else 1024
    metrics = torch.zeros(bins + 1, dtype=torch.float64 if rt.now("dtype") else torch.float32)
    metrics[0] = loss.detach()
    metrics[1:] = torch.histc(out.detach().float(), bins=bins, min=-4, max=4)
    with rt.coll():
        if rt.now("op"):
            dist.broadcast(metrics, src=0)
        else:
            dist.all_reduce(metrics)


def run_ddp(rt: Runtime) -> None:
    torch.manual_seed(0)
    with rt.coll():  # DDP's constructor broadcasts the parameters
        model = DDP(mlp(), bucket_cap_mb=0.008)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rt.rank)
    for _ in rt.steps():
        x = torch.randn(16, 32, generator=gen)
        y = torch.randn(16, 8, generator=gen)
        out = model(x)
        loss = nn.functional.mse_loss(out, y)
        with rt.coll():  # the reducer all-reduces the gradient buckets during backward
            loss.backward()
        opt.step()
        opt.zero_grad()
        log_metrics(rt, loss, out)


def fsdp2_mlp(rt: Runtime) -> tuple[nn.Module, torch.optim.Optimizer, torch.Generator]:
    """The FSDP2 shapes' model (every Linear sharded, then the whole), its optimizer and
    this rank's data generator."""
    from torch.distributed.device_mesh import init_device_mesh  # imported by main()
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (rt.world,))
    model = mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt, torch.Generator().manual_seed(rt.rank)


def run_fsdp2(rt: Runtime) -> None:

    model, opt, gen = fsdp2_mlp(rt)
    for _ in rt.steps():
        x = torch.randn(16, 32, generator=gen)
        y = torch.randn(16, 8, generator=gen)
        with rt.coll():  # FSDP2 all-gathers each layer's parameters
            out = model(x)
        loss = nn.functional.mse_loss(out, y)
        with rt.coll():  # ... and reduce-scatters its gradients
            loss.backward()
        opt.step()
        opt.zero_grad()
        log_metrics(rt, loss, out)


def run_moe(rt: Runtime) -> None:
    """One MoE layer per step, Megatron/DeepSpeed style, on EP x DP = 4 x (world / 4)."""
    ep_size = 4
    if rt.world % ep_size:
        raise SystemExit("moe: WORLD_SIZE must be a multiple of 4")
    ep_group = dp_group = None
    for first in range(0, rt.world, ep_size):
        ranks = list(range(first, first + ep_size))
        g = dist.new_group(ranks, group_desc="expert_parallel")
        rt.beat()
        if rt.rank in ranks:
            ep_group = g
    for i in range(ep_size):
        ranks = list(range(i, rt.world, ep_size))
        g = dist.new_group(ranks, group_desc="data_parallel")
        rt.beat()
        if rt.rank in ranks:
            dp_group = g
    assert ep_group is not None and dp_group is not None
    tokens, hidden = 16, 32
    gen = torch.Generator().manual_seed(1000 + rt.rank)
    expert = torch.randn(hidden, hidden, generator=gen) / hidden
    for _ in rt.steps():
        # sequence-parallel activations gathered over the expert-parallel group
        local = torch.randn(tokens, hidden, generator=gen)
        full = torch.empty(tokens * ep_size, hidden)
        with rt.coll():
            dist.all_gather_into_tensor(full, local, group=ep_group)
        # router: how many of this rank's tokens go to each expert (one per EP rank)
        counts = torch.randint(0, 12, (ep_size,), generator=gen, dtype=torch.int64)
        recv_counts = torch.empty_like(counts)
        with rt.coll():
            dist.all_to_all_single(recv_counts, counts, group=ep_group)
        send = torch.randn(int(counts.sum()), hidden, generator=gen)
        recv = torch.empty(int(recv_counts.sum()), hidden)
        # dispatch: uneven splits, different on every rank
        if not rt.now("skip"):
            with rt.coll():
                dist.all_to_all_single(
                    recv,
                    send,
                    output_split_sizes=recv_counts.tolist(),
                    input_split_sizes=counts.tolist(),
                    group=ep_group,
                )
        out = torch.tanh(recv @ expert)
        back = torch.empty(int(counts.sum()), hidden)
        # combine: the expert outputs go back where the tokens came from
        with rt.coll():
            dist.all_to_all_single(
                back,
                out,
                output_split_sizes=counts.tolist(),
                input_split_sizes=recv_counts.tolist(),
                group=ep_group,
            )
        # backward: sequence-parallel gradient reduce-scatter, expert gradients over DP
        grad_full = torch.randn(tokens * ep_size, hidden, generator=gen)
        grad_shard = torch.empty(tokens, hidden)
        expert_grad = torch.randn(hidden, hidden, generator=gen)
        if rt.now("dtype"):
            expert_grad = expert_grad.to(torch.float64)
        # router statistics (per-expert load, aux losses) averaged over the world
        stats = torch.randn(4096, generator=gen)
        if rt.now("size"):
            stats = torch.randn(3072, generator=gen)
        if rt.now("order"):  # the world statistics before the data-parallel gradients
            with rt.coll():
                dist.all_reduce(stats)
        with rt.coll():
            reduce_scatter(grad_shard, grad_full, group=ep_group)
        with rt.coll():
            if rt.now("op"):
                dist.broadcast(expert_grad, group=dp_group, group_src=0)
            else:
                dist.all_reduce(expert_grad, group=dp_group)
        if not rt.now("order"):
            with rt.coll():
                dist.all_reduce(stats)
        expert -= 1e-3 * expert_grad.float()


def run_pipeline(rt: Runtime) -> None:
    """One stage per rank, two micro-batches per step: forward by send/recv, backward by
    batch_isend_irecv, then the gradient norm and the loss over all stages."""
    stage, last = rt.rank, rt.world - 1
    gen = torch.Generator().manual_seed(rt.rank)
    weight = torch.randn(32, 32, generator=gen) / 32
    micro = 2
    for _ in rt.steps():
        acts = []
        for mb in range(micro):
            act = torch.randn(8, 32, generator=gen) if stage == 0 else torch.empty(8, 32)
            if stage > 0:
                with rt.coll():
                    dist.recv(act, src=stage - 1)
            act = torch.tanh(act @ weight)
            acts.append(act)
            if stage < last and not (rt.now("skip") and mb == micro - 1):
                with rt.coll():
                    dist.send(act, dst=stage + 1)
        grad_sq = torch.zeros(1)
        for act in reversed(acts):
            grad = torch.ones(8, 32) if stage == last else torch.empty(8, 32)
            if stage < last:
                with rt.coll():
                    for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, grad, stage + 1)]):
                        work.wait()
            grad = grad * (1 - act * act)
            grad_sq += (grad * grad).sum()
            if stage > 0:
                with rt.coll():
                    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, grad, stage - 1)]):
                        work.wait()
        rt.stop_point("reduce")
        with rt.coll():
            if rt.now("op"):
                dist.broadcast(grad_sq, src=0)
            else:
                dist.all_reduce(grad_sq)
        loss = acts[-1].pow(2).mean().reshape(1) if stage == last else torch.zeros(1)
        with rt.coll():
            dist.all_reduce(loss)
        weight -= 1e-3 * weight * grad_sq.sqrt()


def run_multigroup(rt: Runtime) -> None:
    """examples/faulty_job.py's step: TP pairs, DP groups, the world group."""
    tp_group = dp_group = None
    for first in range(0, rt.world, 2):
        ranks = [first, first + 1]
        g = dist.new_group(ranks, group_desc="tensor_parallel")
        rt.beat()
        if rt.rank in ranks:
            tp_group = g
    for tp_index in range(2):
        ranks = list(range(tp_index, rt.world, 2))
        g = dist.new_group(ranks, group_desc="data_parallel")
        rt.beat()
        if rt.rank in ranks:
            dp_group = g
    assert tp_group is not None and dp_group is not None
    dp_size = dist.get_world_size(dp_group)
    shard_len = 2048
    gen = torch.Generator().manual_seed(rt.rank)
    for _ in rt.steps():
        activations = torch.randn(16, 256, generator=gen)
        if not rt.now("skip"):
            with rt.coll():
                dist.all_reduce(activations, group=tp_group)
        shard = torch.randn(16, 128, generator=gen)
        gathered = [torch.empty_like(shard) for _ in range(2)]
        with rt.coll():
            dist.all_gather(gathered, shard, group=tp_group)
        grads = torch.randn(shard_len * dp_size, generator=gen)
        grad_shard = torch.empty(shard_len)
        with rt.coll():
            reduce_scatter(grad_shard, grads, group=dp_group)
        loss = torch.tensor([float(rt.step)])
        if rt.now("order"):  # the loss before the gradients: the peers do it the other way
            with rt.coll():
                dist.all_reduce(loss)
        if rt.now("dtype"):
            grads = grads.to(torch.float64)
        with rt.coll():
            dist.all_reduce(grads, group=dp_group)
        if rt.now("op"):
            with rt.coll():
                dist.broadcast(loss, src=0)
        elif not rt.now("order"):
            with rt.coll():
                dist.all_reduce(loss)
        schedule = torch.zeros(16 if rt.now("size") else 8)
        with rt.coll():
            dist.broadcast(schedule, src=0)


def run_pp1f1b(rt: Runtime) -> None:
    """``torch.distributed.pipelining``: one stage per rank, ``Schedule1F1B`` over
    ``PP_MICROBATCHES`` micro-batches (its P2P by ``batch_isend_irecv``), then the loss
    broadcast from the last stage as training scripts log it. Each step the stages reach that
    broadcast in reverse stage order (the last stage's backward ends first, stage 0's last):
    the schedule draining, not a slow rank."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)  # 4 ranks share the machine's cores; stage compute stays serial
    stage_index, last = rt.rank, rt.world - 1
    torch.manual_seed(stage_index)
    width = 512  # enough compute per micro-batch that the drain shows (tens of ms per stage)
    module = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())
    stage = PipelineStage(module, stage_index, rt.world, torch.device("cpu"))
    # every stage passes the loss function: without it a stage's schedule runs no backward
    schedule = Schedule1F1B(stage, n_microbatches=PP_MICROBATCHES, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)  # every stage draws the same batch and targets
    for _ in rt.steps():
        x = torch.randn(32 * PP_MICROBATCHES, width, generator=gen)
        y = torch.randn(32 * PP_MICROBATCHES, width, generator=gen)
        losses: list[torch.Tensor] = []
        with rt.coll():  # the schedule's forward sends/recvs and backward recvs/sends
            if stage_index == 0:
                schedule.step(x)
            elif stage_index == last:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
        opt.step()
        opt.zero_grad()
        loss = torch.stack(losses).mean().reshape(1) if losses else torch.zeros(1)
        with rt.coll():
            dist.broadcast(loss, src=last)


def run_fsdp2dcp(rt: Runtime) -> None:
    """FSDP2 (as ``fsdp2``) saving its sharded state with ``torch.distributed.checkpoint.save``
    every ``DCP_EVERY`` steps and at the last. ``--fault write-error``: at ``--fault-step``'s
    save, the fault rank's storage write fails with ``OSError(ENOSPC)``; DCP gathers every
    rank's write result and raises one ``CheckpointException`` naming that rank on all ranks,
    which exit with it."""
    import errno

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    class Writer(dcp.FileSystemWriter):
        def write_data(self, plan, planner):  # noqa: ANN001, ANN202 - DCP's signature
            if rt.now("write-error"):
                print(f"rank {rt.rank}: injecting write-error at step {rt.step}", file=sys.stderr)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write_data(plan, planner)

    ckpt = Path(rt.args.ckpt_dir) if rt.args.ckpt_dir else ckpt_dir_default(rt)
    model, opt, gen = fsdp2_mlp(rt)
    for step in rt.steps():
        x = torch.randn(16, 32, generator=gen)
        y = torch.randn(16, 8, generator=gen)
        with rt.coll():
            out = model(x)
        loss = nn.functional.mse_loss(out, y)
        with rt.coll():
            loss.backward()
        opt.step()
        opt.zero_grad()
        log_metrics(rt, loss, out)
        if step % DCP_EVERY == 0 or step == rt.args.steps:
            try:
                with rt.coll():  # DCP's plan gather, write-result gather and broadcasts
                    dcp.save(
                        {"model": model.state_dict()}, storage_writer=Writer(ckpt / f"step_{step}")
                    )
            except CheckpointException as exc:  # a BaseException: main's handler misses it
                rt.done()
                rt.dump(f"checkpoint failed: {str(exc).splitlines()[0][:200]}")
                raise


def ckpt_dir_default(rt: Runtime) -> Path:
    """Beside the heartbeat folder (the harness's work folder), else a temporary folder
    shared by the job's ranks (keyed by its rendezvous port)."""
    if rt.args.heartbeat_dir:
        return Path(rt.args.heartbeat_dir).parent / "ckpt"
    import tempfile

    return Path(tempfile.gettempdir()) / f"corpus-ckpt-{os.environ['MASTER_PORT']}"


def run_tiny300(rt: Runtime) -> None:
    """A long healthy run of tiny collectives (``--steps``, 300 in the corpus): each step
    all-reduces a 1-element loss, every 10th broadcasts a 1-element learning rate and
    all-gathers a 1-element counter; then a ``barrier`` and, right after it, the Flight
    Recorder dump, no pause (Gloo may not have retired the barrier on every rank yet)."""
    lr = torch.zeros(1)
    for step in rt.steps():
        loss = torch.tensor([float(rt.rank + step)])
        with rt.coll():
            dist.all_reduce(loss)
        if step % 10 == 0:
            with rt.coll():
                dist.broadcast(lr, src=0)
            counts = [torch.zeros(1) for _ in range(rt.world)]
            with rt.coll():
                dist.all_gather(counts, torch.tensor([float(step)]))
    with rt.coll():
        dist.barrier()
    rt.dump("finished (right after the final barrier)")
    rt.dumped_at_end = True


RUNNERS = {
    "ddp": run_ddp,
    "fsdp2": run_fsdp2,
    "moe": run_moe,
    "pipeline": run_pipeline,
    "multigroup": run_multigroup,
    "pp1f1b": run_pp1f1b,
    "fsdp2dcp": run_fsdp2dcp,
    "tiny300": run_tiny300,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, required=True)
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=3)
    parser.add_argument(
        "--fault-at",
        choices=("step", "reduce"),
        default="step",
        help="where compute/gil/kill/... strike: the start of the step, or (pipeline only) "
        "after the step's send/recv, before its world all-reduces",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--straggle-ms", type=float, default=30.0)
    parser.add_argument("--fr-dir", default=None, help="PyTorch Flight Recorder dumps go here")
    parser.add_argument("--hang-seconds", type=float, default=4.0)
    parser.add_argument(
        "--ckpt-dir", default=None, help="fsdp2dcp: checkpoints go here (default: beside hb)"
    )
    parser.add_argument("--heartbeat-dir", default=None)
    parser.add_argument("--pg-timeout", type=float, default=120.0)
    parser.add_argument(
        "--linger-on-error",
        type=float,
        default=0.0,
        help="seconds a rank whose collective failed stays up after its dump before it raises "
        "(writing a checkpoint, flushing logs): its sockets stay open, so the failure does "
        "not cascade to the ranks still blocked in the op",
    )
    args = parser.parse_args(argv)
    if args.fault not in (
        "none",
        "straggler",
        "never-init",
        *STOPS,
    ) and args.fault not in SHAPE_FAULTS.get(args.shape, ()):
        parser.error(f"--fault {args.fault} is not implemented for --shape {args.shape}")
    if args.fr_dir is not None:
        Path(args.fr_dir).mkdir(parents=True, exist_ok=True)

    import faulthandler

    if args.shape in ("fsdp2", "fsdp2dcp"):  # seconds on a loaded machine: during set-up
        import importlib

        importlib.import_module("torch.distributed.fsdp")

    # the harness asks for every thread's stack (into this rank's log) before it kills a hung
    # job: where each rank stood, for whoever reads the log
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    rt = Runtime(args)
    never_init(rt)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    if args.fr_dir is not None:
        # The first dump with entries imports torch._dynamo to symbolize their stacks (800
        # modules, seconds on a loaded machine): pay that now, not while the watchdog
        # should be dumping a hang.
        import importlib

        importlib.import_module("torch._dynamo")
    rt.start_watchdog()
    try:
        RUNNERS[args.shape](rt)
    except Exception as exc:
        rt.done()
        if is_collective_error(exc):
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            rt.dump(f"collective failed: {first[:200]}")
            time.sleep(args.linger_on_error)
        raise
    rt.done()
    if not rt.dumped_at_end:
        # Gloo marks a work completed from a callback that may run just after wait()
        # returned; give it a moment so that a healthy run's last op does not read as pending.
        time.sleep(0.2)
        rt.dump("finished")
    dist.barrier()  # leave together: an early exit resets the peers' connections
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)
