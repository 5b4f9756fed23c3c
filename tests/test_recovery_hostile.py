"""Recovery that a store client outside the job cannot steer (issue 20).

The job's TCPStore has no authentication: anyone who can reach it can write the keys an
agreement reads. Real 3-rank Gloo jobs with ``frtools.recovery`` on train normally while a
separate ``TCPStore`` client (``is_master=False``) writes forged keys: a decision dropping
every rank, or one healthy rank, an old ``t0``, an inflated ``count``, a forged summary.
No rank leaves, the job finishes its steps, and a later real hang is still recovered from
correctly. With ``FRTOOLS_JOB_SECRET`` the forged keys are refused as unauthenticated.
Then the same checks on one store, without a job: members, handles, MACs, windows.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from jobs import free_port, start_ranks, stop, wait_ranks

from frtools.recovery import Policy
from frtools.recovery.agreement import Agreement, Guard
from frtools.recovery.decision import DROP, Decision, disagreement
from frtools.recovery.membership import check_handles

HAS_RECONFIGURE = hasattr(dist, "_reconfigure")
needs_215 = pytest.mark.skipif(not HAS_RECONFIGURE, reason="frtools.recovery needs torch >= 2.15")
BASE = "frtools/recovery/0/fail/1/"

# A small training loop with recovery on: every rank all-reduces a tensor each step (50 ms
# apart); rank 0 counts steps in the store; the rank named by the store key ``test/hang``
# hangs in its own code at its next step (a real fault, started when the test says so).
WORKER = textwrap.dedent(
    """
    import datetime, os, sys, time
    import torch, torch.distributed as dist
    import frtools.recorder, frtools.recovery

    rank, steps = int(os.environ["RANK"]), int(sys.argv[1])
    frtools.recorder.enable()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    recovery = frtools.recovery.Recovery(frtools.recovery.Policy(exit_when_excluded=True))
    store = recovery.store
    total = torch.zeros(4)
    step = 0
    while step < steps:
        try:
            if store.check(["test/hang"]) and int(store.get("test/hang")) == rank:
                print(f"rank {rank}: hanging at step {step}", flush=True)
                time.sleep(600)
            t = torch.ones(4)
            dist.all_reduce(t)
            total += t / dist.get_world_size()
        except RuntimeError as exc:
            try:
                incident = recovery.recover(exc)
            except frtools.recovery.Excluded:
                print(f"rank {rank}: excluded", flush=True)
                sys.exit(0)
            print(f"rank {rank}: recovered without {incident.dropped}", flush=True)
            continue
        if dist.get_rank() == 0:
            store.set("test/step", str(step))
        recovery.after_step(step)
        step += 1
        time.sleep(0.05)
    print(f"rank {rank}: DONE {steps} steps on {dist.get_world_size()} ranks", flush=True)
    recovery.close()
    dist.destroy_process_group()
    """
)


def _forged_decision(drop: list[int], members_after: list[int] | None = None) -> str:
    members = [0, 1, 2]
    doc = {
        "format": "frtools-recovery-decision", "key": "fail/1", "trigger": "failure",
        "leader": 0, "decided_ns": time.time_ns(), "members_before": members, "drop": drop,
        "members_after": members_after or [m for m in members if m not in drop],
        "action": "drop", "reason": "forged", "kind": "missing", "headline": "forged",
        "guilty": drop, "hosts": [], "published": members,
    }  # fmt: skip
    return json.dumps(doc)


def _step(client: dist.TCPStore) -> int:
    return int(client.get("test/step")) if client.check(["test/step"]) else -1


def _wait_step(client: dist.TCPStore, step: int, procs: list, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _step(client) < step:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            return
        time.sleep(0.05)


def _job(tmp_path: Path, steps: int, attack, secret: str | None = None) -> tuple:
    """A 3-rank job whose store the test hosts; ``attack(client, procs)`` runs, as a second
    store client, while it trains. Returns (exit codes, every rank's output)."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))  # fmt: skip
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {"FRTOOLS_DIR": str(tmp_path / "frtools"), "FRTOOLS_STALL_SECONDS": "5",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    if secret is not None:
        env["FRTOOLS_JOB_SECRET"] = secret
    procs = start_ranks([sys.executable, str(script), str(steps)], 3, env=env, port=port)
    try:
        client = dist.TCPStore("127.0.0.1", port, is_master=False,
                               timeout=datetime.timedelta(seconds=30))  # fmt: skip
        attack(client, procs)
        result = wait_ranks(procs, timeout=180)
    finally:
        stop(procs)
        del store
    out = result.output()
    (tmp_path / "job.log").write_text(out)
    return [r.returncode for r in result.ranks], out


def _forge(client: dist.TCPStore, drop: list[int]) -> None:
    """What the attacker writes: an agreement begun long ago, its summaries all counted, a
    forged summary of rank 1 and a decision."""
    client.set(BASE + "t0", "1000")
    client.set(BASE + "count", "99")
    client.set(BASE + "summary/1", '{"format":"frtools-summary"}')
    client.set(BASE + "decision", _forged_decision(drop))


@needs_215
@pytest.mark.timeout(300)
def test_forged_decision_dropping_every_rank_drops_none(tmp_path):
    def attack(client, procs):
        _wait_step(client, 3, procs)
        _forge(client, [0, 1, 2])

    codes, out = _job(tmp_path, 60, attack)
    assert codes == [0, 0, 0], out[-6000:]
    assert out.count("DONE 60 steps on 3 ranks") == 3, out[-6000:]
    assert "dropped from the job" not in out and "excluded" not in out
    assert "ignored" in out  # the forged decision is ignored, and said so


@needs_215
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_forged_decision_dropping_one_rank_is_ignored_and_a_real_hang_still_recovers(tmp_path):
    def attack(client, procs):
        _wait_step(client, 3, procs)
        _forge(client, [1])
        _wait_step(client, 20, procs)  # rank 1 trains on; then rank 2 really hangs
        client.set("test/hang", "2")

    codes, out = _job(tmp_path, 60, attack)
    assert codes[:2] == [0, 0], out[-6000:]
    assert "rank 1: dropped" not in out and "rank 1: excluded" not in out
    assert out.count("recovered without [2]") == 2, out[-6000:]
    assert out.count("DONE 60 steps on 2 ranks") == 2, out[-6000:]
    assert "does not follow from the evidence" in out or "ignored" in out


@needs_215
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_with_a_job_secret_unauthenticated_keys_are_ignored_with_a_warning(tmp_path):
    def attack(client, procs):
        _wait_step(client, 3, procs)
        _forge(client, [1])
        client.set(BASE + "leader", "1")
        _wait_step(client, 20, procs)
        client.set("test/hang", "2")

    codes, out = _job(tmp_path, 60, attack, secret="s3cret-of-this-job")
    assert codes[:2] == [0, 0], out[-6000:]
    assert "unauthenticated" in out and BASE + "decision" in out
    assert "rank 1: dropped" not in out
    assert out.count("recovered without [2]") == 2, out[-6000:]
    assert out.count("DONE 60 steps on 2 ranks") == 2, out[-6000:]
    assert "s3cret-of-this-job" not in out


# -- the same checks on one store, without a job --------------------------------------------


def _decision(members: list[int], **kw) -> Decision:
    drop = kw.pop("drop", [2])
    base = dict(
        key="fail/1", trigger="failure", leader=members[0], decided_ns=time.time_ns(),
        members_before=members, drop=drop, members_after=[m for m in members if m not in drop],
        action=DROP, reason="t", kind="missing", headline="h", guilty=drop, hosts=[],
        published=members,
    )  # fmt: skip
    base.update(kw)
    return Decision(**base)


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"members_before": [0, 1, 2, 7], "members_after": [0, 1, 7]}, "members"),
        ({"members_after": [0, 7]}, "members"),
        ({"leader": 9}, "leader"),
        ({"drop": [2, 1], "members_after": [0], "guilty": [1, 2]}, "max_drop_fraction"),
        ({"published": [0, 1, 2, 5]}, "members"),
    ],
)
def test_decision_naming_ranks_outside_the_job_or_policy_is_refused(change, reason):
    d = _decision([0, 1, 2], **change)
    assert reason in disagreement(d, members=[0, 1, 2], policy=Policy())


def test_reconfigure_handle_naming_a_rank_outside_the_job_is_refused():
    check_handles(["gloo:0:-1:0:", "gloo:2:-1:2:"], [0, 1, 2], [0, 2])
    with pytest.raises(ValueError, match="names rank 5"):
        check_handles(["gloo:0:-1:0:", "gloo:5:-1:5:"], [0, 1, 2], [0, 2])
    with pytest.raises(ValueError, match="twice"):
        check_handles(["gloo:0:-1:0:", "gloo:0:-1:0:"], [0, 1, 2], [0, 2])


def test_authenticated_values_pass_and_forged_ones_are_ignored_once(capsys):
    store = dist.HashStore()
    said: list[str] = []
    guard = Guard(secret=b"k", say=said.append)
    ag = Agreement(store, BASE, 0, [0, 1], guard=guard)
    ag.publish(b"my summary")
    store.set(BASE + "summary/1/1", b"forged")
    store.set(BASE + "summary/1", b"1")
    assert ag.collect(time.time_ns() + 200_000_000) == {0: b"my summary"}
    ag.collect(time.time_ns())
    assert len([s for s in said if "summary/1" in s]) == 1  # one warning, not one per look
    assert "unauthenticated" in said[0]
    other = Agreement(store, BASE, 1, [0, 1], guard=Guard(secret=b"other key", say=said.append))
    assert other.collect(time.time_ns()) == {}  # a different job's secret proves nothing


def test_inflated_count_and_old_t0_do_not_cut_the_leaders_wait_short():
    store = dist.HashStore()
    store.set(BASE + "t0", "1000")
    store.set(BASE + "count", "99")
    ag = Agreement(store, BASE, 0, [0, 1, 2], poll_s=0.01)
    ag.start()
    ag.publish(b"s0")
    t = time.monotonic()
    got = ag.collect(time.time_ns() + 400_000_000)
    assert sorted(got) == [0] and time.monotonic() - t >= 0.35


def test_forged_leader_outside_the_job_is_replaced():
    store = dist.HashStore()
    store.set(BASE + "leader", "77")
    ag = Agreement(store, BASE, 1, [0, 1, 2])
    assert ag.claim_lead() and ag.leader() == 1


def test_frtools_run_hands_each_job_a_secret_and_keeps_one_given():
    code = "import os; print(os.environ['FRTOOLS_JOB_SECRET'])"
    env = {k: v for k, v in os.environ.items() if k != "FRTOOLS_JOB_SECRET"}

    def secret(**extra: str) -> str:
        res = subprocess.run(
            [sys.executable, "-m", "frtools", "run", "--", sys.executable, "-c", code],
            capture_output=True, text=True, timeout=60, env=dict(env, **extra),
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        return res.stdout.strip()

    first, second = secret(), secret()
    assert len(first) == 64 and int(first, 16) >= 0 and first != second
    assert secret(FRTOOLS_JOB_SECRET="given by the launcher") == "given by the launcher"
