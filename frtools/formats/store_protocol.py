"""The job-wide dump protocol: keys in the job's own TCPStore.

Shared by the requester (``frtools.collect.jobwide``: ``frtools dump --job-wide``; a stalled
rank) and every rank's watcher thread (``frtools.recorder.jobwide``): the keys, the encoding
of requests, registrations and answers, and gathering the answers into a manifest all live
here, so neither side imports the other. All keys sit under one prefix
(``FRTOOLS_STORE_PREFIX``, default ``frtools/``) on the *raw* store, the one
``TCPStore(host, port, is_master=False)`` sees, not under c10d's ``default_pg/`` prefix.

* ``<P>dump_seq`` — counter; a requester ``add``s 1 and gets its request's number.
* ``<P>dump/<seq>`` — the request, JSON: ``kind`` (``request``, ``stall``), ``reason``,
  ``by``, ``time_ns``: a label, nothing more. It names no place: every rank writes into its
  own ``FRTOOLS_DUMP_DIR`` (a ``dir`` key, which older versions sent, is ignored).
* ``<P>dump/<seq>/answered`` — counter of ranks that wrote their snapshot and stacks.
* ``<P>dump/<seq>/rank/<R>`` — one rank's answer, JSON: rank, host, pid, dir (where it
  wrote, for the user to read; a collector checks it before reading there), files,
  copy_seq (the request its copy was written for: an earlier one when rate limited), note.
* ``<P>rank/<R>`` — a rank's registration when its watcher starts: host, pid, blackbox, job.
* ``<P>progress/<R>`` — a rank's beacon, rewritten every ``FRTOOLS_PROGRESS_INTERVAL`` s and
  when a stall is flagged: the op it is in and its groups' frontiers (``formats.progress``),
  for ``frtools top --job-wide`` on any host.

The store has no authentication: anyone who can reach it can write these keys. What a rank
reads from it is a request number and a label; what a collector reads from it is shown, or
checked against its own configuration before any file is read.
* ``<P>world_size`` — the job's world size, set by every watcher.
* ``<P>stall_claim`` — time (ns) of the last stall request; the first rank to see a stall
  swaps in its time (``compare_set``) and issues the request.
"""

from __future__ import annotations

import json
import time
from typing import Any

from frtools.formats.limits import strict_int
from frtools.formats.manifest import BOX_SUFFIX, STACKS_SUFFIX, Manifest, RankEntry, rank_file_name

# a world size read from the store above this is not believed (the store is not authenticated)
MAX_WORLD_SIZE = 1 << 20


def seq_key(prefix: str) -> str:
    return f"{prefix}dump_seq"


def request_key(prefix: str, seq: int) -> str:
    return f"{prefix}dump/{seq}"


def answered_key(prefix: str, seq: int) -> str:
    return f"{prefix}dump/{seq}/answered"


def answer_key(prefix: str, seq: int, rank: int) -> str:
    return f"{prefix}dump/{seq}/rank/{rank}"


def rank_key(prefix: str, rank: int) -> str:
    return f"{prefix}rank/{rank}"


def progress_key(prefix: str, rank: int) -> str:
    return f"{prefix}progress/{rank}"


def world_size_key(prefix: str) -> str:
    return f"{prefix}world_size"


def stall_claim_key(prefix: str) -> str:
    return f"{prefix}stall_claim"


def encode(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"))


def decode(raw: bytes | str) -> dict[str, Any]:
    """A protocol value as a dict; ``{}`` when it is not one (never raises)."""
    try:
        value = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def unwrap_store(store: Any) -> Any:
    """The raw store under c10d's PrefixStores (``default_pg/`` and group prefixes)."""
    inner = getattr(store, "underlying_store", None)
    while inner is not None and inner is not store:
        store, inner = inner, getattr(inner, "underlying_store", None)
    return store


def issue_request(store: Any, prefix: str, request: dict[str, Any]) -> int:
    """Publish a dump request; every rank's watcher answers it. Returns its number."""
    seq = int(store.add(seq_key(prefix), 1))
    store.set(request_key(prefix, seq), encode(request))
    return seq


def latest_request(store: Any, prefix: str, after: int) -> tuple[int, dict[str, Any]] | None:
    """(number, request) of the newest request if it is newer than ``after``, else None."""
    current = int(store.add(seq_key(prefix), 0))
    if current > after and store.check([request_key(prefix, current)]):
        return current, decode(store.get(request_key(prefix, current)))
    return None


def current_seq(store: Any, prefix: str) -> int:
    """The number of the newest request (0: none yet)."""
    return int(store.add(seq_key(prefix), 0))


def register_rank(
    store: Any, prefix: str, rank: int, *, host: str, pid: int, blackbox: str, job: str = ""
) -> None:
    """A rank's watcher says where it runs, where its black box is and its job id."""
    store.set(
        rank_key(prefix, rank),
        encode({"host": host, "pid": pid, "blackbox": blackbox, "job": job}),
    )


def set_world_size(store: Any, prefix: str, world_size: int) -> None:
    store.set(world_size_key(prefix), str(world_size))


def post_answer(
    store: Any,
    prefix: str,
    seq: int,
    rank: int,
    *,
    host: str,
    pid: int,
    directory: str,
    files: list[str],
    blackbox: str,
    copy_seq: int | None = None,
    note: str = "",
) -> None:
    """A rank's answer to request ``seq``: ``files`` are in ``directory`` (written for request
    ``copy_seq``: ``seq``, or an earlier one when rate limited, as ``note`` says)."""
    store.set(
        answer_key(prefix, seq, rank),
        encode(
            {
                "rank": rank,
                "host": host,
                "pid": pid,
                "dir": directory,
                "files": files,
                "blackbox": blackbox,
                "copy_seq": seq if copy_seq is None else copy_seq,
                "note": note,
            }
        ),
    )
    store.add(answered_key(prefix, seq), 1)


def _text(value: object) -> str | None:
    return value[:256] if isinstance(value, str) else None


def answer_files(answer: dict[str, Any], rank: int) -> list[str]:
    """The files an answer names, kept only when they are this rank's own file names."""
    own = {rank_file_name(rank, BOX_SUFFIX), rank_file_name(rank, STACKS_SUFFIX)}
    files = answer.get("files")
    return [f for f in files if f in own] if isinstance(files, list) else []


def gather_answers(
    store: Any,
    prefix: str,
    seq: int,
    manifest: Manifest,
    timeout: float,
    answers: dict[int, dict[str, Any]] | None = None,
) -> Manifest:
    """Wait up to ``timeout`` s for every registered rank to answer request ``seq``, then
    fill ``manifest`` with who answered and who did not (and where their black box is).
    ``answers`` receives each rank's answer as read (untrusted: anyone can write the store)."""
    world = None
    if store.check([world_size_key(prefix)]):
        raw = store.get(world_size_key(prefix)).decode(errors="replace")
        world = strict_int(raw, lo=1, hi=MAX_WORLD_SIZE)
    manifest.world_size = manifest.world_size or world
    deadline = time.monotonic() + timeout
    while world and time.monotonic() < deadline:
        if int(store.add(answered_key(prefix, seq), 0)) >= world:
            break
        time.sleep(0.1)
    ranks = range(world) if world else range(0)
    for rank in ranks:
        entry = RankEntry(rank=rank)
        manifest.ranks[rank] = entry
        if store.check([answer_key(prefix, seq, rank)]):
            answer = decode(store.get(answer_key(prefix, seq, rank)))
            entry.host, entry.pid = _text(answer.get("host")), strict_int(answer.get("pid"))
            entry.answered, entry.alive = True, True
            entry.files = answer_files(answer, rank)
            entry.note = _text(answer.get("note")) or ""
            if answers is not None:
                answers[rank] = answer
            continue
        where = "its black box"
        if store.check([rank_key(prefix, rank)]):
            reg = decode(store.get(rank_key(prefix, rank)))
            entry.host, entry.pid = _text(reg.get("host")), strict_int(reg.get("pid"))
            where = f"its black box {_text(reg.get('blackbox'))} on {entry.host}"
            entry.note = (
                "did not answer through the store (process gone, or its Python threads "
                "cannot run, e.g. a thread holds the GIL); "
                f"{where} is collected by `frtools dump` run on that host"
            )
        else:
            entry.note = "never registered (recorder not enabled on this rank?)"
    if manifest.ranks_no_answer:
        manifest.notes.append(
            "ranks "
            + ", ".join(map(str, manifest.ranks_no_answer))
            + " did not answer: run `frtools dump -o DIR` on their hosts to collect their "
            "black boxes (see each rank's note)"
        )
    if not world:
        manifest.notes.append("no rank has registered in this store (is the recorder on?)")
    return manifest
