"""Alignment: seq matching, per-member status, completion sources, wrap, coalesced, P2P."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from frtools.analyze.align import _duplicated_units, align, as_texts, text_series
from frtools.model.trace import ProcessGroup, RankInfo, Trace, entries_table

pytestmark = pytest.mark.timeout(60)


def row(rank, seq, pg="0", op="all_reduce", **kw):
    base = {
        "rank": rank,
        "record_id": kw.pop("record_id", seq),
        "pg_name": pg,
        "pg_desc": "default_pg" if pg == "0" else "undefined",
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "is_p2p": False,
        "op": op,
        "input_sizes": "[[4]]",
        "output_sizes": "[[4]]",
        "input_dtypes": "Float",
        "output_dtypes": "Float",
        "state": "scheduled",
        "time_created_ns": kw.pop("t", seq * 1000 + rank),
    }
    base.update(kw)
    return base


def make(rows, ranks=4, pg_status=None, wrapped=(), groups=None) -> Trace:
    infos = {r: RankInfo(rank=r, wrapped=r in wrapped) for r in range(ranks)}
    for r, st in (pg_status or {}).items():
        infos[r].pg_status = st
    pgs = groups or {"0": ProcessGroup("0", "default_pg", tuple(range(ranks)))}
    return Trace(entries=entries_table(rows), ranks=infos, process_groups=pgs, world_size=ranks)


def test_each_seq_lists_which_members_issued_it():
    rows = [row(r, s) for r in range(4) for s in (1, 2)] + [row(r, 3) for r in (0, 1, 2)]
    view = align(make(rows)).group("0").seq_view()
    assert list(view.index) == [1, 2, 3]
    assert view.loc[3].notna().tolist() == [True, True, True, False]


def test_status_gives_last_issued_and_last_completed_per_member():
    rows = [row(r, s, retired=s < 3) for r in range(4) for s in (1, 2, 3) if (r, s) != (3, 3)]
    status = align(make(rows)).group("0").status
    assert status.loc[0, "last_issued"] == 3 and status.loc[0, "last_completed"] == 2
    assert status.loc[3, "last_issued"] == 2 and status.loc[3, "last_completed"] == 2


def test_pg_status_completes_entries_only_when_nothing_else_says():
    # No `retired`, states uninformative: pg_status decides.
    rows = [row(0, s) for s in (1, 2, 3)]
    st = {0: {"0": {"last_enqueued_collective": 3, "last_completed_collective": 2}}}
    coll = align(make(rows, ranks=1, pg_status=st)).collectives.sort_values("seq")
    assert coll["completed"].tolist() == [True, True, False]
    # `retired` wins over pg_status (Gloo's counters also count unrecorded send/recv).
    rows = [row(0, 1, retired=True), row(0, 2, retired=False)]
    st = {0: {"0": {"last_enqueued_collective": 3, "last_completed_collective": 2}}}
    coll = align(make(rows, ranks=1, pg_status=st)).collectives.sort_values("seq")
    assert coll["completed"].tolist() == [True, False]


def test_pg_status_fills_last_issued_for_a_group_without_entries():
    rows = [row(0, 1)]
    st = {1: {"0": {"last_enqueued_collective": 7, "last_completed_collective": 7}}}
    status = align(make(rows, ranks=2, pg_status=st)).status
    assert status.loc[(1, "0"), "last_issued"] == 7


def test_no_completion_info_is_unknown_not_false():
    coll = align(make([row(0, 1)], ranks=1)).collectives
    assert coll["completed"].isna().all()


def test_wrapped_rank_starts_later_but_has_issued_the_older_seqs():
    rows = [row(r, s) for r in (0, 1) for s in range(1, 6)] + [row(2, s) for s in (4, 5)]
    al = align(make(rows, ranks=3, wrapped=(2,)))
    assert al.status.loc[(2, "0"), "first_seq"] == 4
    assert al.status.loc[(2, "0"), "last_issued"] == 5


def test_coalesced_ops_are_one_unit():
    def block(rank, second="[[8]]"):
        marker = {"input_sizes": "", "output_sizes": "", "input_dtypes": "", "output_dtypes": ""}
        return [
            row(rank, 1, record_id=0, input_sizes="[[4]]", output_sizes="[[4]]"),
            row(rank, 1, record_id=1, input_sizes=second, output_sizes=second),
            row(rank, 1, op="coalesced", record_id=2, **marker),
        ]

    coll = align(make(block(0) + block(1), ranks=2)).collectives.sort_values("rank")
    assert coll["op"].tolist() == ["coalesced", "coalesced"]
    assert coll["input_sizes"].tolist() == ["[[4]];[[8]]", "[[4]];[[8]]"]
    assert coll["sig"].nunique() == 1
    coll = align(make(block(0) + block(1, "[[2]]"), ranks=2)).collectives
    assert coll["sig"].nunique() == 2


def test_kth_send_matches_kth_recv_of_the_pair_with_global_peers():
    def p2p(rank, op, peer, k):
        return row(
            rank,
            0,
            pg="pp",
            op=op,
            is_p2p=True,
            peer=peer,
            p2p_seq_id=k,
            record_id=k,
            t=k * 1000 + rank,
        )

    # Rank 4 sends to 6 twice and to 5 once; p2p_seq_id counts per rank, not per pair.
    rows = [p2p(4, "send", 6, 1), p2p(4, "send", 5, 2), p2p(4, "send", 6, 3)]
    rows += [p2p(6, "recv", 4, 1), p2p(6, "recv", 4, 2), p2p(5, "recv", 4, 1)]
    groups = {"pp": ProcessGroup("pp", "", (4, 5, 6))}
    al = align(make(rows, ranks=7, groups=groups))
    p = al.p2p.sort_values(["rank", "record_id"])
    sends = p[p["rank"] == 4]
    assert list(zip(sends["receiver"], sends["pair_index"], strict=True)) == [
        (6, 0),
        (5, 0),
        (6, 1),
    ]
    recvs = p[p["rank"] == 6]
    assert list(zip(recvs["sender"], recvs["pair_index"], strict=True)) == [(4, 0), (4, 1)]


@pytest.mark.parametrize("block", [7, None])  # rows a step at a time: a few; the default
@pytest.mark.parametrize("ranks", [4, 40])  # every (rank, group) numbered densely; those in use
@pytest.mark.parametrize("top_seq", [50, 2**26])  # packed into one int64; too big to pack
def test_duplicated_units_are_the_rows_sharing_rank_group_and_seq(
    top_seq, ranks, block, monkeypatch
):
    if block is not None:
        monkeypatch.setattr("frtools.analyze.align._BLOCK", block)
    rng = np.random.default_rng(7)
    n = 3000
    frame = pd.DataFrame(
        {
            "rank": rng.integers(0, ranks, n).astype(np.int32),
            "pg_name": pd.Categorical(rng.choice(["0", "1", "tp", "dp"], n)),
            "collective_seq_id": rng.integers(1, top_seq, n),
        }
    )
    frame.loc[5, "pg_name"] = np.nan  # no group: code -1
    expected = frame.duplicated(keep=False).to_numpy()
    if top_seq == 50:  # the packed path sees real duplicates
        assert 0 < expected.sum() < n
    got = _duplicated_units(frame)
    assert got.tolist() == expected.tolist()
    assert not _duplicated_units(frame.drop_duplicates()).any()


@pytest.mark.parametrize("ranks", [40, 3000])  # (rank, group in use) numbered by a table; hashed
def test_duplicated_units_of_a_group_table_mostly_unused(ranks):
    """Boxes list every group of their rank, most of which no entry is on: the (rank, group)
    units are numbered among the groups in use, with the same answer as hashing them."""
    rng = np.random.default_rng(11)
    n = 3000
    names = [f"g{i}" for i in range(20000)]  # the categories: every group of every table
    used = rng.choice(len(names), 6, replace=False)
    frame = pd.DataFrame(
        {
            "rank": rng.integers(0, ranks, n).astype(np.int32),
            "pg_name": pd.Categorical.from_codes(
                rng.choice(np.append(used, -1), n), categories=names
            ),
            "collective_seq_id": rng.integers(1, 30, n),
        }
    )
    expected = frame.duplicated(keep=False).to_numpy()
    assert 0 < expected.sum() < n
    assert _duplicated_units(frame).tolist() == expected.tolist()
    assert not _duplicated_units(frame.drop_duplicates()).any()


def test_alignment_does_not_depend_on_how_many_rows_a_step_takes(monkeypatch):
    """The signature, the coalesced units and the per-member status are worked out a block
    of rows at a time (their temporaries stay small at millions of rows): blocks of a few
    rows give the frames one block gives."""
    rng = np.random.default_rng(5)
    rows = []
    for rank in range(6):
        for seq in range(1, 40):
            pg = ["0", "tp", "dp"][seq % 3]
            state = "completed" if seq < 30 + rank else "scheduled"
            op = ["all_reduce", "all_gather", "broadcast"][int(rng.integers(0, 3))]
            sizes = f"[[{int(rng.integers(1, 4))}]]"
            rows.append(row(rank, seq, pg=pg, op=op, state=state, input_sizes=sizes))
            if seq % 7 == 0:  # a coalesced block: two ops of one seq
                rows.append(row(rank, seq, pg=pg, state=state, record_id=1000 + seq))
    groups = {g: ProcessGroup(g, "", tuple(range(6))) for g in ("0", "tp", "dp")}
    whole = align(make(rows, ranks=6, groups=groups))
    monkeypatch.setattr("frtools.analyze.align._BLOCK", 5)
    blocked = align(make(rows, ranks=6, groups=groups))
    assert whole.collectives["sig"].nunique() > 3 and (whole.collectives["op"] == "coalesced").any()
    pd.testing.assert_frame_equal(blocked.collectives, whole.collectives)
    pd.testing.assert_frame_equal(blocked.status, whole.status)


@pytest.mark.parametrize(
    "values",
    [
        pd.Series(pd.Categorical(["tp", None, "dp", "tp"])),
        pd.Series(pd.Categorical([3, 1, None])),
        pd.Series(["a", "b", "a"], dtype=object),
        pd.Series(["a", None, 3], dtype=object),
        pd.Series(["a", "b"], dtype="str"),
        pd.Series([1, 2, 3]),
        pd.Series(pd.Categorical([], categories=["x"])),
    ],
)
def test_as_texts_is_astype_str_to_numpy(values: pd.Series) -> None:
    """The diagnosis's groups and ops as text, without pandas 3's Arrow detour: the same
    object array ``astype(str).to_numpy()`` gives, NaN where a value is missing."""
    got, want = as_texts(values), values.astype(str).to_numpy()
    assert got.dtype == object and len(got) == len(want)
    assert [None if isinstance(v, float) else v for v in got] == [
        None if isinstance(v, float) else v for v in want
    ]
    assert all(type(v) is str or (isinstance(v, float) and np.isnan(v)) for v in got)


def test_text_series_keeps_python_strings_so_isin_and_merges_hash_them() -> None:
    """A key column built for ``isin`` and merges stays object dtype under pandas 3 (an
    Arrow string column converts every value asked for one at a time), with the values of
    ``as_texts``, and a frame built from it keeps it so."""
    values = pd.Series(pd.Categorical(["tp", None, "dp", "tp"]), index=[7, 8, 9, 10])
    got = text_series(values)
    assert got.dtype == object and got.index.tolist() == [0, 1, 2, 3]
    assert got.iloc[[0, 2, 3]].tolist() == ["tp", "dp", "tp"] and pd.isna(got.iloc[1])
    frame = pd.DataFrame({"pg_name": got, "seq": np.arange(4)})
    assert frame["pg_name"].dtype == object
    assert frame["pg_name"].isin({"tp"}).tolist() == [True, False, False, True]
