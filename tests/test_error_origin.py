"""One error, one root (diagnosis/origin.py): an error that one rank raised and every rank
re-raised names its root; the real FSDP2 + checkpoint job is a corpus case."""

from __future__ import annotations

from frtools.analyze.diagnosis.facts import Ending
from frtools.analyze.diagnosis.origin import named_ranks, shared_errors

DCP = (
    "torch.distributed.checkpoint.api.CheckpointException: CheckpointException "
    "ranks:dict_keys([2])\nTraceback (most recent call last): (RANK 2)\n"
    '  File "/x/torch/distributed/checkpoint/filesystem.py", line 1, in write_data\n'
    "OSError: [Errno 28] No space left on device"
)


def _died(text: str) -> Ending:
    return Ending("exception", text, True, True, False)


def test_checkpoint_exception_on_every_rank_names_the_rank_whose_write_failed() -> None:
    [err] = shared_errors({r: _died(DCP) for r in range(4)}, range(4))
    assert err.roots == (2,) and err.casualties == (0, 1, 3)


def test_ranks_outside_the_job_are_never_roots() -> None:
    assert named_ranks("CheckpointException ranks:dict_keys([7, 2])", range(4)) == (2,)
    assert shared_errors({r: _died(DCP.replace("[2]", "[9]").replace("RANK 2", "RANK 9"))
                          for r in range(4)}, range(4)) == []  # fmt: skip


def test_different_errors_or_one_rank_make_no_shared_error() -> None:
    endings = {0: _died(DCP), 1: _died("ValueError: bad batch on rank 1")}
    assert shared_errors(endings, range(4)) == []


def test_an_error_naming_every_rank_that_raised_it_has_no_single_root() -> None:
    text = "RuntimeError: ranks [0, 1] failed"
    assert shared_errors({0: _died(text), 1: _died(text)}, range(2)) == []


def test_a_hostile_rank_list_is_read_bounded() -> None:
    text = "ranks [" + ", ".join(str(i) for i in range(200_000)) + "]"
    assert len(named_ranks(text, range(10))) <= 10
