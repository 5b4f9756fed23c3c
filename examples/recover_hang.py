"""One rank hangs (or is killed) at step N; the others drop it and finish every step.

A real Gloo job on torch >= 2.15 with ``frtools.recovery``: a small DDP model trains on
every rank; at ``--fault-step`` rank ``--fault-rank`` hangs in its own code (``--fault
hang``, a sleep standing for a wedged GPU or a deadlock) or SIGKILLs itself (``--fault
kill``). The survivors' collective fails after the group timeout (``FRTOOLS_STALL_SECONDS``,
5 s here), they agree on one verdict through the store, drop the guilty rank, re-broadcast
the model from the new rank 0 and finish every step. The hung rank learns it was dropped
and leaves (exit 0).

Under torchrun (its agent hosts the store, as recovery needs)::

    FRTOOLS_STALL_SECONDS=5 python -m torch.distributed.run --nproc-per-node 8 \\
        examples/recover_hang.py --fault-rank 3 --fault-step 5

or with the small launcher below, which does the same (hosts the store outside the workers,
starts them, stops whatever is left when the survivors are done) and also runs the kill
fault (under torchrun a worker killed by a signal stops the whole job, by torchelastic's
design)::

    python examples/recover_hang.py --nproc 8 --fault kill

Each survivor prints ``RECOVERED <seconds>`` (hang onset -> first step finished on the
survivors) and ``DONE``; the launcher exits 0 when every survivor finished every step with
the same parameters. Incident records: ``<FRTOOLS_DIR>/<job>/dumps/recovery/``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=0, help="launch this many workers (0: I am one)")
    p.add_argument("--fault", choices=["hang", "kill", "slow", "none"], default="hang")
    p.add_argument("--fault-rank", type=int, default=3)
    p.add_argument("--fault-step", type=int, default=5)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--hang-seconds", type=float, default=600.0)
    p.add_argument("--stall-seconds", type=float, default=5.0, help="FRTOOLS_STALL_SECONDS")
    p.add_argument("--slow-ms", type=float, default=80.0, help="--fault slow: late by this")
    p.add_argument("--straggler-every", type=int, default=0, help="check every N steps")
    p.add_argument("--drop-stragglers", action="store_true", help="policy: drop them")
    p.add_argument("--dir", help="FRTOOLS_DIR for the workers (black boxes, incidents)")
    p.add_argument("--timeout", type=float, default=240.0, help="launcher: give up after")
    return p.parse_args(argv)


# -- the launcher (no torch until it hosts the store) --------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace) -> int:
    import datetime

    import torch.distributed as dist

    port = free_port()
    # the store lives here, outside the workers (torchrun's agent does the same)
    store = dist.TCPStore("127.0.0.1", port, args.nproc, is_master=True,
                          timeout=datetime.timedelta(seconds=300), wait_for_workers=False)  # fmt: skip
    env = dict(
        os.environ,
        WORLD_SIZE=str(args.nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # env:// connects to our store as a client
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        FRTOOLS_STALL_SECONDS=os.environ.get("FRTOOLS_STALL_SECONDS", str(args.stall_seconds)),
    )
    if args.dir:
        env["FRTOOLS_DIR"] = args.dir
    argv = [a for a in sys.argv[1:]]
    procs = []
    for rank in range(args.nproc):
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--nproc", "0"]
        procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank))))
    faulty = args.fault_rank if args.fault in ("hang", "kill") or args.drop_stragglers else -1
    survivors = [p for r, p in enumerate(procs) if r != faulty]
    deadline = time.monotonic() + args.timeout
    try:
        for p in survivors:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        print("[launcher] survivors did not finish in time", flush=True)
    finally:
        for p in procs:  # the dropped rank, if it did not leave by itself, and any straggler
            if p.poll() is None:
                p.kill()
            p.wait()
        del store
    codes = [p.returncode for p in procs]
    print(f"[launcher] exit codes: {codes}", flush=True)
    return 0 if all(c == 0 for r, c in enumerate(codes) if r != faulty) else 1


# -- a worker ------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import frtools.recorder
    import frtools.recovery

    launch_rank = int(os.environ["RANK"])
    t_start = time.time()

    def log(*a: object) -> None:  # one write per line: 8 ranks share the launcher's pipe
        line = " ".join([f"[rank {launch_rank} t={time.time() - t_start:6.2f}s]", *map(str, a)])
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    frtools.recorder.enable()  # the black box, before the default group exists
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))

    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1000 + launch_rank)
    w_true = torch.arange(16, dtype=torch.float32) / 16
    # after the set-up collectives (DDP's): from here on a collective waiting longer than
    # FRTOOLS_STALL_SECONDS fails. A hung rank learns it was dropped from frtools' thread
    # and leaves by itself (under torchrun a rank that never exits would keep the job alive)
    policy = frtools.recovery.Policy(
        exit_when_excluded=True,
        straggler_check_every=args.straggler_every,
        drop_stragglers=args.drop_stragglers,
    )
    recovery = frtools.recovery.Recovery(policy)
    store = recovery.store

    def resync() -> None:
        """After a recovery: every survivor takes the new rank 0's parameters."""
        with torch.no_grad():
            for p in model.module.parameters():
                dist.broadcast(p.data, src=0)

    def train_step(step: int) -> float:
        slow = launch_rank == args.fault_rank and args.fault == "slow"
        if slow:  # a slow GPU: late into each of the step's collectives
            time.sleep(args.slow_ms / 2000)
        if (
            launch_rank == args.fault_rank
            and step == args.fault_step
            and args.fault in ("hang", "kill")
        ):
            store.set("example/onset", repr(time.time()))
            if args.fault == "kill":
                log("fault: SIGKILL myself")
                os.kill(os.getpid(), signal.SIGKILL)
            log(f"fault: hanging in my own code at step {step}")
            time.sleep(args.hang_seconds)
        x = torch.randn(32, 16, generator=data)
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), x @ w_true)
        opt.zero_grad()
        loss.backward()  # DDP's all_reduce: raises when a peer hangs or died
        opt.step()
        if slow:
            time.sleep(args.slow_ms / 2000)
        stats = torch.tensor([loss.item(), 1.0])
        dist.all_reduce(stats)
        return stats[0].item() / stats[1].item()

    step = 0
    recovered_at = None
    while step < args.steps:
        try:
            mean_loss = train_step(step)
        except RuntimeError as exc:
            log(f"step {step}: collective failed: {str(exc).splitlines()[0][:100]}")
            try:
                incident = recovery.recover(exc)
            except frtools.recovery.Excluded:
                log("dropped from the job; leaving")
                return 0
            log(f"dropped {incident.dropped} ({incident.kind}); now rank "
                f"{dist.get_rank()} of {dist.get_world_size()}; redoing step {step}")  # fmt: skip
            resync()
            recovered_at = step
            continue
        if recovered_at == step:
            onset = float(store.get("example/onset").decode())
            log(f"RECOVERED {time.time() - onset:.2f} s after the hang's onset")
        if dist.get_rank() == 0:
            log(f"step {step}: mean loss {mean_loss:.4f} over {dist.get_world_size()} ranks")
        try:
            if recovery.after_step(step) is not None:  # a straggler was dropped
                resync()
        except frtools.recovery.Excluded:
            log("dropped from the job as a straggler; leaving")
            return 0
        step += 1
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    log(
        f"DONE {args.steps} steps on {dist.get_world_size()} ranks; checksum {params.sum().item():.6f}"
    )
    recovery.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    a = parse()
    sys.exit(launch(a) if a.nproc > 0 else worker(a))
