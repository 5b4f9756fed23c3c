"""The job-wide dump protocol: keys in the job's own TCPStore.

Shared by the requester (``frtools dump --job-wide``, a stalled rank) and every rank's
watcher thread (``frtools.recorder.jobwide``). All keys sit under one prefix
(``FRTOOLS_STORE_PREFIX``, default ``frtools/``) on the *raw* store, the one
``TCPStore(host, port, is_master=False)`` sees, not under c10d's ``default_pg/`` prefix.

* ``<P>dump_seq`` — counter; a requester ``add``s 1 and gets its request's number.
* ``<P>dump/<seq>`` — the request, JSON: ``dir`` (where to write; null: each rank's own
  ``FRTOOLS_DUMP_DIR``), ``reason``, ``by``, ``time_ns``.
* ``<P>dump/<seq>/answered`` — counter of ranks that wrote their snapshot and stacks.
* ``<P>dump/<seq>/rank/<R>`` — one rank's answer, JSON: rank, host, pid, dir, files.
* ``<P>rank/<R>`` — a rank's registration when its watcher starts: host, pid, blackbox.
* ``<P>world_size`` — the job's world size, set by every watcher.
* ``<P>stall_claim`` — time (ns) of the last stall request; the first rank to see a stall
  swaps in its time (``compare_set``) and issues the request.
"""

from __future__ import annotations

import json
import os
from typing import Any

DEFAULT_PREFIX = "frtools/"


def prefix_from_env() -> str:
    return os.environ.get("FRTOOLS_STORE_PREFIX", DEFAULT_PREFIX)


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
    for attr in ("_underlying_non_prefix_store", "underlying_store"):
        inner = getattr(store, attr, None)
        if inner is not None:
            return unwrap_store(inner) if inner is not store else inner
    return store


def issue_request(store: Any, prefix: str, request: dict[str, Any]) -> int:
    """Publish a dump request; every rank's watcher answers it. Returns its number."""
    seq = int(store.add(seq_key(prefix), 1))
    store.set(request_key(prefix, seq), encode(request))
    return seq
