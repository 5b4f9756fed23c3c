"""The real-job corpus: (shape, fault, fault rank, ranks, recorder) -> the verdict it must get.

Every expected answer comes from what really happened in the job (the injected fault and
what Gloo did with it, seen in the ranks' logs and exit codes), stated in the kinds of
docs/verdict.md plus ``inconclusive``: the data cannot name a rank. ``why`` says what happens
and why that verdict is the right one. Importing this module imports nothing heavy.

Recorders: ``fr`` — PyTorch's own Flight Recorder, each rank dumping in-process
(``train.py --fr-dir``): a rank that is killed, exits, aborts or holds the GIL leaves no
dump, and a Gloo dump states neither the world size nor group membership. ``frtools`` —
the job under ``frtools run``, collected with ``frtools dump``: every rank's black box
survives its process, with the world size and membership in its header.

``run_of``: the case analyzes the dumps of another case's job (the same job, analyzed with
other ``analyze_args``), so one job serves both.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("healthy", "missing", "dead", "mismatch", "order", "stuck", "straggler", "inconclusive")


@dataclass(frozen=True)
class Case:
    id: str
    shape: str
    fault: str
    fault_rank: int | None
    ranks: int
    recorder: str  # "fr" or "frtools"
    kind: str  # the expected verdict kind
    guilty: tuple[int, ...]  # the exact guilty rank set
    why: str  # what happens, and why this verdict is the right one
    # acceptable member sets of verdict.process_group, where it matters (None: not checked)
    groups: tuple[tuple[int, ...], ...] | None = None
    steps: int = 5
    fault_step: int = 3
    fault_at: str = "step"  # train.py --fault-at
    # train.py --linger-on-error: a rank whose collective failed stays up this long after its
    # dump (the harness kills a job that makes no progress for HANG_AFTER, well before)
    linger_on_error: float = 0.0
    analyze_args: tuple[str, ...] = ()
    run_of: str | None = None
    reported: bool = False  # one of the failures reported from real jobs
    # the job hangs in start-up (inside init_process_group): the harness judges the hang once
    # every rank is past its set-up (train.py's ``rank_<R>.up``), not once training started
    startup_hang: bool = False

    @property
    def exit_code(self) -> int:
        return 0 if self.kind == "healthy" else 1

    @property
    def job(self) -> str:
        """The id of the case whose job produces this case's dumps."""
        return self.run_of or self.id

    @property
    def expected(self) -> str:
        ranks = ",".join(map(str, self.guilty))
        return f"{self.kind} [{ranks}]" if self.guilty else self.kind


# A note on GIL holders under PyTorch's FR: the holder's watchdog thread cannot run, so it
# leaves no dump; docs/verdict.md's `dead` is "the rank the others wait for has no usable
# dump", and the data cannot tell a dead process from a wedged one. Under frtools the
# holder's native watchdog still answers `frtools dump` (alive, with its stacks): `missing`.

# fmt: off
CASES: tuple[Case, ...] = (
    # -- the failures reported from real jobs -------------------------------------------
    Case("moe8-healthy-fr", "moe", "none", None, 8, "fr", "healthy", (),
         "8-rank MoE (EP 4 x DP 2), no fault. Token dispatch/combine all_to_all_single have "
         "uneven, per-rank split sizes by design: different input/output sizes at one "
         "all_to_all are not a mismatch.",
         reported=True),
    Case("moe8-healthy-frtools", "moe", "none", None, 8, "frtools", "healthy", (),
         "The same healthy MoE job recorded by frtools. Uneven all_to_all sizes are normal, "
         "and Gloo's reduce_scatter work never reports completion: the last reduce_scatter of "
         "each EP group stays 'scheduled' in a finished job.",
         reported=True),
    Case("ddp-sigkill-r2-frtools", "ddp", "sigkill", 2, 4, "frtools", "dead", (2,),
         "DDP, rank 2 SIGKILLs itself at step 20 (of 25). Gloo fails the survivors' next "
         "all_reduce with 'Connection closed/reset by peer'; they exit with the exception. "
         "Rank 2's black box ends at step 19, its process is gone.",
         steps=25, fault_step=20, reported=True),
    Case("ddp-exit-r2-frtools", "ddp", "exit", 2, 4, "frtools", "dead", (2,),
         "DDP, rank 2 calls os._exit(1) at step 20 (of 25); as for SIGKILL the survivors' next "
         "all_reduce fails with a connection error.",
         steps=25, fault_step=20, reported=True),
    Case("ddp8-size-r7-fr", "ddp", "size", 7, 8, "fr", "dead", (7,),
         "8-rank DDP; at step 9 rank 7 all-reduces a 769-float metrics vector where its peers "
         "pass 1025 (world all_reduce #31). Gloo aborts rank 7 (gloo::EnforceNotMet, SIGABRT): "
         "no dump. Ranks that exchange with it (its ring neighbours 0 and 6, sometimes more) "
         "leave the op with a connection error, retired (completed in pg_status), dump, and "
         "stay up writing a checkpoint, as in the report; the others stay blocked in #31 and "
         "dump from their watchdog (5 of 7 in one run, 3 in another). A job of one group: "
         "Gloo's nameless pg_config entry lists the world, [0, ..., 7] (torch 2.13 and 2.15), "
         "so rank 7 is an expected member without a dump, and the blocked ranks wait for it: "
         "dead (its sizes are recorded nowhere: not mismatch).",
         steps=11, fault_step=9, linger_on_error=10.0, reported=True),
    Case("ddp8-size-r7-fr-ws", "ddp", "size", 7, 8, "fr", "dead", (7,),
         "The same dumps analyzed with --world-size 8 (the user knows it): rank 7 has no dump "
         "and every blocked rank waits for it in world all_reduce #31. Its sizes are not "
         "recorded anywhere (it died before dumping), so the evidence supports dead, not "
         "mismatch.",
         analyze_args=('--world-size', '8'), run_of='ddp8-size-r7-fr', reported=True),
    # -- ddp ----------------------------------------------------------------------------
    Case("ddp-healthy-fr", "ddp", "none", None, 4, "fr", "healthy", (),
         "DDP, no fault; every rank dumps at the end."),
    Case("ddp-sigkill-r2-fr", "ddp", "sigkill", 2, 4, "fr", "dead", (2,),
         "The reported SIGKILL under PyTorch's FR: rank 2 leaves no dump (a gap in the file "
         "names); the survivors dump on their connection error, the failed op retired.",
         steps=25, fault_step=20),
    Case("ddp-gil-r1-fr", "ddp", "gil", 1, 4, "fr", "dead", (1,),
         "Rank 1 holds the GIL in a C call (its FR watchdog thread cannot run: no dump); ranks "
         "0, 2, 3 block in the next all_reduce and dump. docs/verdict.md: the rank the others "
         "wait for has no usable dump -> dead."),
    Case("ddp-gil-r3-fr", "ddp", "gil", 3, 4, "fr", "dead", (3,),
         "The highest rank holds the GIL: no dump. A job of one group: Gloo's nameless "
         "pg_config entry lists the world, [0, 1, 2, 3], so rank 3 is an expected member "
         "without a dump, and ranks 0-2 are blocked in the all_reduce it never joined: dead "
         "(docs/verdict.md: the rank the others wait for has no usable dump). Without that "
         "list (a job with subgroups) the data could not tell it from a 3-rank job."),
    Case("ddp-gil-r2-frtools", "ddp", "gil", 2, 4, "frtools", "missing", (2,),
         "Rank 2 holds the GIL; its native watchdog answers frtools dump (alive, stacks in "
         "hold_gil). It never issued the all_reduce ranks 0, 1, 3 wait in: missing."),
    Case("ddp-compute-r3-frtools", "ddp", "compute", 3, 4, "frtools", "missing", (3,),
         "The highest rank hangs in compute (time.sleep) before step 3; the others wait in the "
         "reducer's all_reduce. frtools headers state the world size, so rank 3 is visible."),
    Case("ddp-segfault-r1-frtools", "ddp", "segfault", 1, 4, "frtools", "dead", (1,),
         "Rank 1 segfaults (SIGSEGV); its black box survives, process gone; the survivors' "
         "next all_reduce fails on its closed sockets."),
    Case("ddp-straggler-r1-fr", "ddp", "straggler", 1, 4, "fr", "straggler", (1,),
         "Rank 1 sleeps 30 ms before every collective (backward and logging); the job "
         "completes.",
         steps=12),
    # -- fsdp2 --------------------------------------------------------------------------
    Case("fsdp2-healthy-fr", "fsdp2", "none", None, 4, "fr", "healthy", (),
         "FSDP2 (fully_shard per Linear and the root), no fault."),
    Case("fsdp2-healthy-frtools", "fsdp2", "none", None, 4, "frtools", "healthy", (),
         "FSDP2, no fault, recorded by frtools (_allgather_base / _reduce_scatter_base)."),
    Case("fsdp2-compute-r1-fr", "fsdp2", "compute", 1, 4, "fr", "missing", (1,),
         "Rank 1 hangs in compute before step 3's forward; the others wait in the first "
         "parameter all-gather; every rank dumps from its watchdog."),
    Case("fsdp2-exception-r2-frtools", "fsdp2", "exception", 2, 4, "frtools", "dead", (2,),
         "Rank 2 raises a CUDA-error RuntimeError before step 3 and exits 1; the survivors' "
         "all-gather fails on its closed sockets."),
    Case("fsdp2-dtype-r3-frtools", "fsdp2", "dtype", 3, 4, "frtools", "mismatch", (3,),
         "At step 3 rank 3 all-reduces its metrics in float64, its peers in float32. Gloo "
         "aborts rank 2 (it receives 1032 bytes where it expects 516: SIGABRT); the others "
         "block or fail. Every black box survives: rank 3's records Double at the metrics "
         "all_reduce, the others' Float. The odd rank is 3, not the one Gloo killed."),
    Case("fsdp2-straggler-r2-frtools", "fsdp2", "straggler", 2, 4, "frtools", "straggler", (2,),
         "Rank 2 sleeps 30 ms before every forward, backward and logging all_reduce; the job "
         "completes.",
         steps=12),
    # -- moe ----------------------------------------------------------------------------
    Case("moe8-skip-r5-frtools", "moe", "skip", 5, 8, "frtools", "missing", (5,),
         "Rank 5 skips the step-3 token-dispatch all_to_all_single on EP group [4-7] and goes "
         "on to the combine: at EP seq 13 its all_to_all comes from the combine line (call "
         "site), its peers' from the dispatch line. The exchange of mismatched splits makes "
         "Gloo abort ranks 4 and 5 (SIGABRT); 6 and 7 fail. It never issued the dispatch its "
         "EP peers issued: missing, not the ranks Gloo killed."),
    Case("moe8-sigkill-r3-fr", "moe", "sigkill", 3, 8, "fr", "dead", (3,),
         "Rank 3 is SIGKILLed before step 3 (no dump: a gap in the file names). EP peers 0-2 "
         "fail in all_gather #11 (retired) and exit; rank 4 then blocks in DP all_reduce #3 "
         "waiting for rank 0, a victim of rank 3."),
    Case("moe8-size-r7-frtools", "moe", "size", 7, 8, "frtools", "mismatch", (7,),
         "Rank 7 passes 3072 floats to the world statistics all_reduce, its peers 4096. Gloo "
         "aborts rank 7, but its black box survives and records [[3072]]: the cause is "
         "visible.",
         groups=((0, 1, 2, 3, 4, 5, 6, 7),)),
    # -- pipeline -----------------------------------------------------------------------
    Case("pipeline-healthy-fr", "pipeline", "none", None, 4, "fr", "healthy", (),
         "4 stages, send/recv forward, batch_isend_irecv backward, no fault."),
    Case("pipeline-healthy-frtools", "pipeline", "none", None, 4, "frtools", "healthy", (),
         "The same healthy pipeline recorded by frtools (every send/recv recorded)."),
    Case("pipeline-compute-r1-frtools", "pipeline", "compute", 1, 4, "frtools", "missing", (1,),
         "Stage 1 hangs in compute before step 3: stage 2 waits in recv from 1, stage 0 in its "
         "send to 1 or its backward recv from 1; stage 3 waits on stage 2, a victim."),
    Case("pipeline-compute-r2-fr", "pipeline", "compute", 2, 4, "fr", "missing", (2,),
         "Stage 2 hangs in compute after its step-3 send/recv, before the world grad-norm "
         "all_reduce; every other stage finishes its P2P and waits in that all_reduce. Gloo's "
         "FR records no send/recv, but the all_reduce is recorded: rank 2 never issued it.",
         fault_at='reduce'),
    Case("pipeline-skip-r1-frtools", "pipeline", "skip", 1, 4, "frtools", "missing", (1,),
         "Stage 1 skips the forward send of its 2nd micro-batch to stage 2 and goes on to its "
         "backward recv from 2: stage 2 waits in a recv from 1 that 1 never sent."),
    Case("pipeline-op-r3-fr", "pipeline", "op", 3, 4, "fr", "mismatch", (3,),
         "Stage 3 broadcasts where the others all-reduce the gradient norm (world); all hang."),
    # -- multigroup ---------------------------------------------------------------------
    Case("multigroup-order-r1-fr", "multigroup", "order", 1, 4, "fr", "order", (1,),
         "Rank 1 issues the world loss all_reduce before the DP gradient all_reduce, every "
         "other rank the other way round: rank 1 waits for 3 on the world group, 3 for 1 on DP "
         "[1, 3]. Only rank 1's order is its own.",
         groups=((1, 3), (0, 1, 2, 3))),
    Case("multigroup-order-r2-frtools", "multigroup", "order", 2, 4, "frtools", "order", (2,),
         "The same swap on rank 2 (DP peer 0), recorded by frtools.",
         groups=((0, 2), (0, 1, 2, 3))),
    Case("multigroup-op-r3-frtools", "multigroup", "op", 3, 4, "frtools", "mismatch", (3,),
         "Rank 3 broadcasts where its peers all-reduce the world loss; all hang.",
         groups=((0, 1, 2, 3),)),
    Case("multigroup-skip-r2-fr", "multigroup", "skip", 2, 4, "fr", "missing", (2,),
         "Rank 2 skips its step-3 TP all_reduce; its next TP op (all_gather) meets rank 3's "
         "all_reduce at the same seq. It never issued the all_reduce rank 3 waits in."),
    Case("multigroup-dtype-r1-fr", "multigroup", "dtype", 1, 4, "fr", "mismatch", (1,),
         "Rank 1 all-reduces its DP gradients (DP group [1, 3]) in float64, rank 3 in float32. "
         "Gloo aborts rank 3 (8192 bytes where it expects 4096): no dump, and being the "
         "highest rank its absence is invisible. Ranks 0-2 fail and dump; rank 1's dump "
         "records Double at DP all_reduce #6 where the same op of DP group [0, 2] is Float."),
    Case("multigroup-size-r2-frtools", "multigroup", "size", 2, 4, "frtools", "mismatch", (2,),
         "Rank 2 passes a [16] buffer to the world broadcast where its peers pass [8]; Gloo "
         "completes it silently (a larger receive buffer) and the job finishes.",
         groups=((0, 1, 2, 3),)),
    Case("multigroup-segfault-r2-fr", "multigroup", "segfault", 2, 4, "fr", "dead", (2,),
         "Rank 2 segfaults before step 3 (no dump: a gap in the file names); its TP partner 3 "
         "and DP peer 0 fail on its closed sockets (the failed op retired) and exit; rank 1 "
         "then blocks in DP all_reduce #5 waiting for rank 3, a victim."),
)
# fmt: on

# -- start-up (issue 19 item 3) -----------------------------------------------------------
# Under PyTorch's own recorder this job leaves nothing to analyze: no group, no entry, no
# dump (its dumps start with the first group), so it has no fr case: frtools analyze says
# "no usable Flight Recorder dump" (exit 2), all the data allows.
# fmt: off
CASES += (
    Case("never-init-r3-frtools", "ddp", "never-init", 3, 4, "frtools", "missing", (3,),
         "Rank 3 never calls init_process_group (stuck in its set-up). Rank 0, the store's "
         "master, waits in rendezvous for every rank to connect; ranks 1 and 2 wait in Gloo's "
         "connect for rank 3's address in the store. No group exists, no collective is "
         "recorded: the black boxes, open since process start, record each rank's start-up "
         "phase, and rank 3's ends at 'started', alive: missing, the others its victims.",
         startup_hang=True),
    # -- issue 19: pipelining schedule, DCP write error, a long run of tiny collectives --
    Case("pp1f1b-healthy-fr", "pp1f1b", "none", None, 4, "fr", "healthy", (),
         "torch.distributed.pipelining, 4 stages on 4 ranks, Schedule1F1B over 4 micro-batches, "
         "8 steps, then the loss broadcast from stage 3. Each step the stages reach that "
         "broadcast in reverse stage order, tens of ms apart (stage 3's backward ends first, "
         "stage 0's last): the schedule draining, not a slow rank. Once reported as "
         "'straggler [0, 1]'. Gloo's FR records the broadcasts, not the schedule's P2P.",
         steps=8, reported=True),
    Case("pp1f1b-healthy-frtools", "pp1f1b", "none", None, 4, "frtools", "healthy", (),
         "The same 1F1B job recorded by frtools: every batch_isend_irecv of the schedule and "
         "the per-step broadcast, reached late in stage order by the schedule's drain.",
         steps=8, reported=True),
    Case("fsdp2dcp-write-r2-frtools", "fsdp2dcp", "write-error", 2, 4, "frtools", "dead", (2,),
         "FSDP2 saving with torch.distributed.checkpoint.save at step 3: rank 2's storage write "
         "fails with OSError(28, 'No space left on device'). DCP gathers the write results and "
         "raises one CheckpointException naming rank 2 ('ranks:dict_keys([2])', rank 2's "
         "traceback) on all four ranks; all exit 1 with it. Each black box records its rank's "
         "uncaught exception: the same error everywhere, started on rank 2; 0, 1, 3 are its "
         "casualties, not dead ranks of their own.",
         reported=True),
    Case("fsdp2dcp-write-r2-fr", "fsdp2dcp", "write-error", 2, 4, "fr", "healthy", (),
         "The same failing save under PyTorch's FR, each rank dumping as it catches the "
         "CheckpointException. FR records collectives only: the error travels as pickled data "
         "inside DCP's gather_object/broadcast_object_list, and every one of those collectives "
         "was issued by all four ranks with one signature and completed (a rank may show the "
         "last broadcast unretired: Gloo's retirement lag). Nothing in the four dumps tells "
         "this job from one whose checkpoint succeeded, and nothing in them is blocked: "
         "'healthy' is all the records support (the failure is in the exit codes and logs, "
         "which FR does not keep); naming rank 2 needs the exception text frtools records."),
    Case("tiny300-healthy-fr", "tiny300", "none", None, 4, "fr", "healthy", (),
         "300 steps of 1-element collectives (all_reduce each step, broadcast and all_gather "
         "every 10th), a final barrier, each rank's FR dump right after it. Gloo retires a "
         "work a little after wait() returns, so one or two ranks' dumps may show the barrier "
         "unretired: retirement lag at the job's end, not a hang. Once 'inconclusive' in 2 of "
         "3 runs.",
         steps=300, reported=True),
    Case("tiny300-healthy-fr-ws", "tiny300", "none", None, 4, "fr", "healthy", (),
         "The same dumps with --world-size 4: every member is accounted for, and all four "
         "issued the barrier; the verdict follows the records, healthy.",
         steps=300, analyze_args=("--world-size", "4"), run_of="tiny300-healthy-fr",
         reported=True),
    Case("tiny300-healthy-frtools", "tiny300", "none", None, 4, "frtools", "healthy", (),
         "The same 300-step job of tiny collectives recorded by frtools, collected after exit.",
         steps=300),
)
# fmt: on

BY_ID = {c.id: c for c in CASES}
JOBS = {c.id: c for c in CASES if c.run_of is None}  # one job run per entry

# Real-job dump sets committed to sample_dumps/ (name -> (corpus case, torch series it was
# recorded with)); ``python scripts/make_sample_dumps.py --real`` under that torch
# regenerates them and sample_dumps/README.md states each one's verdict.
SAMPLES: dict[str, tuple[str, str]] = {
    "moe-healthy": ("moe8-healthy-fr", "2.13"),
    "crashed": ("ddp-sigkill-r2-fr", "2.13"),
    "crashed-frtools": ("ddp-sigkill-r2-frtools", "2.13"),
    "torch2.15-moe-healthy": ("moe8-healthy-fr", "2.15"),
    "torch2.15-crashed": ("multigroup-segfault-r2-fr", "2.15"),
    "torch2.15-order": ("multigroup-order-r1-fr", "2.15"),
}
