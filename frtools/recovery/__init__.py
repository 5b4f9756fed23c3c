"""Recovery that drops the guilty rank: one bad GPU should not cost the whole job.

Needs torch >= 2.15 (``dist.shrink_group`` / ``dist._reconfigure``) and the recorder
(``frtools.recorder.enable()`` before ``init_process_group``). A training loop adopts it in
a few lines::

    frtools.recorder.enable()                        # the black box; FRTOOLS_STALL_SECONDS=5
    dist.init_process_group("gloo")                  # the store outside the workers (torchrun)
    recovery = frtools.recovery.Recovery()           # collective: barrier, short group timeout
    step = 0
    while step < steps:
        try:
            train_step(model, step)                  # its collectives may raise
        except RuntimeError as exc:
            recovery.recover(exc)                    # agree, drop the guilty rank, rebuild
            resync(model)                            # broadcast from the new rank 0, redo step
            continue
        recovery.after_step(step)
        step += 1

What happens (docs/recovery.md):

1. **Detection.** A collective that waits longer than the group timeout fails (Gloo: the
   only way to release ranks blocked with a hung peer; ``Recovery`` sets it to the
   recorder's ``FRTOOLS_STALL_SECONDS``); a peer that died fails it sooner. The recorder's
   watchdog flagging a stall starts the same path from frtools' own thread.
2. **Agreement** through the job's store (``agreement``): each rank publishes a summary of
   its own black box (``formats.summary``) — also a rank whose main thread is hung
   elsewhere, from frtools' thread; the first rank to ask leads: it waits until every
   member has published or ``summary_window_s`` has passed (members without a summary have
   no record), diagnoses the summaries with ``frtools.analyze.diagnose`` and publishes one
   Decision, which every rank reads.
3. **Dropping** (``membership``): the survivors rebuild the default group without the
   guilty ranks (``shrink_group`` where the backend supports it, else ``_reconfigure``);
   dropped ranks get ``Excluded``. Each survivor writes the verdict and its incident
   record into its dump folder (``incident``).

A persistent straggler can be dropped the same way, by policy only
(``Policy(drop_stragglers=True, straggler_check_every=N)``).
"""

from __future__ import annotations

from frtools.recovery.decision import Decision
from frtools.recovery.incident import Incident
from frtools.recovery.membership import TORCH_REQUIRED
from frtools.recovery.policy import Policy
from frtools.recovery.session import (
    Excluded,
    Recovery,
    RecoveryFailed,
    RecoveryUnavailable,
    incident_paths,
)

__all__ = [
    "TORCH_REQUIRED",
    "Decision",
    "Excluded",
    "Incident",
    "Policy",
    "Recovery",
    "RecoveryFailed",
    "RecoveryUnavailable",
    "incident_paths",
]
