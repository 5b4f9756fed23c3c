"""Bounded work per input file: what one file, however hostile, may cost.

Every dump frtools reads may have been written by anybody who can write to a shared
``/tmp`` or ``/dev/shm`` (docs/security.md). Each limit below is one named value with its
default; a file that trips one is refused with ``InputRefused`` naming the limit and the
reason, and the loader turns that into the file's ``error`` input while the rest of the
analysis goes on. The defaults keep ``frtools analyze`` on any file of up to 10 MB under
1 GB of address space and a few seconds, and are far above what a real dump needs (a
2,000-entry PyTorch dump: ~3 MB, ~50 MB estimated in memory; a frtools black box: 2,000
slots).

``current()`` gives the limits in force: the defaults, changed by ``FRTOOLS_LIMITS``
(``dump_bytes=1G,parsed_bytes=4G``, read once, in ``frtools.config``) and by
``configure(name=value, ...)``, which raises or lowers them for this process (tests, a
program). Worker processes forked by the loader inherit them.

This module also opens files the way every reader and collector must open a file that
someone else may have planted: never blocking on a FIFO, never following a planted link
where that matters, accepting regular files only, and never reading more than a cap.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import operator
import os
import re
import stat
import zlib
from dataclasses import dataclass

from frtools import config

__all__ = [
    "DEFAULTS",
    "InputRefused",
    "Limits",
    "configure",
    "current",
    "file_kind",
    "gunzip",
    "open_regular",
    "read_regular",
    "strict_int",
]

KIB = 1 << 10
MIB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """Each field is one limit; docs/security.md lists them with their meaning."""

    # bytes of one PyTorch dump (pickle or JSON), as stored or once gunzipped
    dump_bytes: int = 128 * MIB
    # a gzip'd file expands to at most this many times its own size or 16 MiB, whichever is
    # larger (and never beyond ``dump_bytes``)
    gunzip_ratio: int = 100
    # memory a pickle or JSON dump would take once parsed, estimated from its opcodes or
    # its structure before anything is built
    parsed_bytes: int = 384 * MIB
    # values a pickle expands to when every shared (memo) reference is counted for what it
    # refers to; a string counts one value per 8 bytes
    expanded_values: int = 1 << 25
    # ... but a file may always take this many bytes of memory (and an eighth as many
    # values) per byte it has on disk: a big real dump is never refused for its size alone,
    # and up to ~12 MB on disk the two limits above decide
    per_stored_byte: int = 32
    # slots of a frtools black box (its ring capacity)
    snapshot_slots: int = 1 << 20
    # rows of a black box's process-group table
    snapshot_groups: int = 1 << 16
    # one interned string of a black box (a stack, a shape list); member-rank texts may be
    # as long as ``model.ranks.MAX_WORLD_SIZE`` ranks need
    string_bytes: int = 1 * MIB
    # all distinct strings of one black box together
    text_bytes: int = 64 * MIB
    # group members listed by one file, all groups together
    members_per_file: int = 1 << 22
    # a file whose size is above this and whose blocks on disk are fewer than 1/8 of its
    # size (a sparse file) is refused: its holes would cost reading time, not data
    sparse_bytes: int = 64 * MIB
    # a ``manifest.json``
    manifest_bytes: int = 64 * MIB
    # a ``rank_<R>.stacks`` file: only its last part is read (the newest dump)
    stacks_bytes: int = 4 * MIB
    # a ``rank_<R>.native`` file (py-spy's JSON of one process's native stacks), read whole
    native_stacks_bytes: int = 4 * MIB
    # one answer of a PyTorch worker server (``frtools dump --torch-socket/--torch-store``)
    response_bytes: int = 128 * MIB
    # a world size (manifest.json, --world-size) or a group's member range (a host summary)
    # may claim at most this many ranks per rank with a record, plus ``ranks_slack``: four
    # small dumps cannot make the analysis expect a million absent ranks
    ranks_per_record: int = 64
    ranks_slack: int = 4096

    def ranks_supported(self, records: int) -> int:
        """The most ranks a world or a group may claim beside ``records`` ranks' records."""
        return self.ranks_per_record * max(records, 1) + self.ranks_slack

    def unsupported_ranks(self, what: str, claimed: int, records: int) -> str | None:
        """None when ``claimed`` ranks are within ``ranks_supported(records)``; else the
        one-line reason, naming the limits."""
        cap = self.ranks_supported(records)
        if claimed <= cap:
            return None
        return (
            f"{what} {claimed:,} is more than {records:,} rank record(s) can support "
            f"({cap:,}: limit ranks_per_record = {self.ranks_per_record} a record, plus "
            f"ranks_slack = {self.ranks_slack})"
        )

    def parsed_cap(self, stored: int) -> int:
        """``parsed_bytes`` for a file of ``stored`` bytes on disk."""
        return max(self.parsed_bytes, self.per_stored_byte * stored)

    def expanded_cap(self, stored: int) -> int:
        """``expanded_values`` for a file of ``stored`` bytes on disk."""
        return max(self.expanded_values, self.per_stored_byte * stored // 8)


INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
# a whole number written as text: ASCII digits, an optional sign, at most 19 digits (int64)
_INT_TEXT = re.compile(r"\s*[-+]?[0-9]{1,19}\s*")


def strict_int(value: object, *, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int | None:
    """The one rule by which a reader turns a value from a file into an int, or ``None``.

    Hostile files put anything where a number belongs, and seven readers used to disagree on
    it. Accepted: an ``int`` (or a numpy integer), a float with no fractional part (a JSON
    writer may write ``3.0``), and text of ASCII digits with an optional sign (PyTorch's
    JSON dumps write counters as ``"-1"``), surrounding blanks allowed. Refused: ``True`` and
    ``False`` (a flag is not a count), ``1.5``, NaN and infinities, ``"1_000"``, ``"٣"``,
    ``"0x10"``, and any value outside ``lo … hi`` (by default int64's range).

    >>> strict_int(" -3 "), strict_int(3.0), strict_int(True), strict_int(7, hi=5)
    (-3, 3, None, None)
    """
    if type(value) is int:  # the common case, first
        n = value
    elif isinstance(value, bool):
        return None
    elif isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            return None
        n = int(value)
    elif isinstance(value, str):
        if len(value) > 64 or not _INT_TEXT.fullmatch(value):
            return None
        n = int(value)
    else:
        try:  # int subclasses and numpy integers; numpy's bool refuses __index__
            n = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            return None
    return n if lo <= n <= hi else None


DEFAULTS = Limits()
_current: Limits | None = None  # None: FRTOOLS_LIMITS not read yet


def current() -> Limits:
    """The limits in force in this process: the defaults changed by ``FRTOOLS_LIMITS`` (read
    on the first call; ``config.ConfigError`` naming the variable for a name that is not a
    limit) and by ``configure``."""
    global _current
    if _current is None:
        _current = from_environment()
    return _current


def from_environment(env: dict[str, str] | None = None) -> Limits:
    """The defaults changed by ``FRTOOLS_LIMITS`` in ``env`` (default: this process's)."""
    changes = config.LIMITS.read(env)
    unknown = set(changes) - {f.name for f in dataclasses.fields(Limits)}
    if unknown:
        raise config.ConfigError(
            f"{config.LIMITS.name}: not a limit: {', '.join(sorted(unknown))} "
            f"(limits: {', '.join(f.name for f in dataclasses.fields(Limits))})"
        )
    return dataclasses.replace(DEFAULTS, **changes)


def configure(**changes: int) -> Limits:
    """Change some limits for this process (``configure(dump_bytes=1 << 30)``); returns the
    previous ones, so that ``configure(**dataclasses.asdict(previous))`` restores them."""
    global _current
    previous = current()
    unknown = set(changes) - {f.name for f in dataclasses.fields(Limits)}
    if unknown:
        raise TypeError(f"not a limit: {', '.join(sorted(unknown))}")
    bad = [name for name, value in changes.items() if not isinstance(value, int) or value < 1]
    if bad:
        raise ValueError(f"a limit is a positive integer: {', '.join(sorted(bad))}")
    _current = dataclasses.replace(previous, **changes)
    return previous


class InputRefused(ValueError):
    """A file refused by a limit or because it is not a regular file; the message is the
    one-line reason shown next to the file's name."""


def size_text(n: int) -> str:
    """``134217728`` -> ``"128 MiB"``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            value = n / size
            return (
                f"{value:.0f} {unit}"
                if value >= 10 or value == int(value)
                else f"{value:.1f} {unit}"
            )
    return f"{n} bytes"


def exceeded(what: str, limit_name: str, limit: int, unit: str = "bytes") -> InputRefused:
    """The refusal for a limit that tripped: ``"<what> (limit <name> = <value>); refused"``."""
    value = size_text(limit) if unit == "bytes" else f"{limit:,}"
    return InputRefused(f"{what} (limit {limit_name} = {value}); refused")


# --- opening files someone else may have planted ---------------------------------------


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is: ``"a FIFO"``, ``"a character device"`` …"""
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a special file"


def open_regular(
    path: str | os.PathLike[str], *, follow_symlinks: bool = True, write: bool = False
) -> tuple[int, os.stat_result]:
    """Open ``path`` for reading (``write``: reading and writing, never creating) and return
    ``(fd, fstat)``, or raise ``InputRefused`` when it is not a regular file: a FIFO (never
    waited on: ``O_NONBLOCK``), a device, a socket, a directory, or — with
    ``follow_symlinks=False`` — a symbolic link (``O_NOFOLLOW``). The file type is checked
    on the opened descriptor, so a file swapped after a ``stat`` cannot get through.
    ``OSError`` for anything else (missing, permission)."""
    flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks:
            raise InputRefused("is a symbolic link, not a regular file; refused") from None
        if exc.errno == errno.ENXIO:  # a FIFO or socket nobody serves, opened for writing
            raise InputRefused("not a regular file; refused") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputRefused(f"is {file_kind(st.st_mode)}, not a regular file; refused")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def check_sparse(st: os.stat_result, limit: Limits | None = None) -> None:
    """Refuse a big file with few blocks on disk: its holes read as zeros, costing time for
    no data (a black box copied or written sparse over a huge claimed size)."""
    lim = limit or current()
    blocks = getattr(st, "st_blocks", None)
    if blocks is None or st.st_size <= lim.sparse_bytes:
        return
    if blocks * 512 * 8 < st.st_size:
        raise exceeded(
            f"sparse file: {size_text(st.st_size)} long but only {size_text(blocks * 512)} on disk",
            "sparse_bytes",
            lim.sparse_bytes,
        )


def read_regular(
    path: str | os.PathLike[str],
    max_bytes: int,
    *,
    limit_name: str,
    follow_symlinks: bool = True,
    tail: bool = False,
) -> bytes:
    """The content of a regular file of at most ``max_bytes`` (``InputRefused`` beyond, or
    with ``tail=True`` only its last ``max_bytes``). Reads what the file holds, never more
    than the cap, whatever its size claims or becomes while it is read."""
    fd, st = open_regular(path, follow_symlinks=follow_symlinks)
    with os.fdopen(fd, "rb") as f:
        if st.st_size > max_bytes:
            if not tail:
                raise exceeded(f"file of {size_text(st.st_size)}", limit_name, max_bytes)
            f.seek(st.st_size - max_bytes)
        want = min(st.st_size, max_bytes)
        data = f.read(want + 1)  # one byte more: a file that grew is seen
        while len(data) <= max_bytes and len(data) > want:  # still growing: read on, capped
            more = f.read(min(max_bytes + 1 - len(data), 1 << 20))
            if not more:
                break
            data += more
    if len(data) > max_bytes:  # grew while read
        if not tail:
            raise exceeded("file grew while read", limit_name, max_bytes)
        data = data[-max_bytes:]
    return data


# --- gzip ----------------------------------------------------------------------------------

GZIP_MAGIC = b"\x1f\x8b"
# a small gzip file may always expand this far (a tiny dump compresses more than 100x)
GUNZIP_FLOOR = 16 * MIB


def gunzip(data: bytes, limit: Limits | None = None) -> bytes:
    """Decompress a gzip file (every member, as ``gzip.decompress``), refusing content larger
    than ``gunzip_ratio`` times the compressed size (at least ``GUNZIP_FLOOR``) or
    ``dump_bytes``, whichever is smaller.
    ``EOFError`` for a truncated archive, ``zlib.error`` for a corrupt one."""
    lim = limit or current()
    by_ratio = max(len(data) * lim.gunzip_ratio, GUNZIP_FLOOR)
    cap = min(lim.dump_bytes, by_ratio)
    out: list[bytes] = []
    total = 0
    rest = data
    while rest:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        pending = rest
        while True:
            chunk = d.decompress(pending, cap - total + 1)
            total += len(chunk)
            out.append(chunk)
            if total > cap:
                if by_ratio < lim.dump_bytes:
                    what = f"gzip content larger than {lim.gunzip_ratio}x its compressed size"
                    raise exceeded(what, "gunzip_ratio", lim.gunzip_ratio, unit="x")
                what = f"gzip content larger than {size_text(cap)}"
                raise exceeded(what, "dump_bytes", lim.dump_bytes)
            pending = d.unconsumed_tail
            if d.eof or (not pending and not chunk):
                break
        if not d.eof:
            raise EOFError("compressed stream ended early")
        # as gzip.decompress: zero padding may follow a member; anything else is not gzip
        rest = d.unused_data.lstrip(b"\x00")
        if rest and not rest.startswith(GZIP_MAGIC):
            raise zlib.error("trailing garbage after the compressed data")
    return b"".join(out)


# --- what parsing a text would cost ----------------------------------------------------------

# estimated bytes per parsed JSON value: a dict (CPython: 232 bytes once it holds an item),
# a list, and any other value (a number or string object and its slot in its parent)
_JSON_DICT = 240
_JSON_LIST = 96
_JSON_VALUE = 64


def json_parsed_bytes(data: bytes) -> int:
    """An upper estimate of the memory ``json.loads(data)`` takes, counted from the
    structural characters before anything is built: every value but the first of a
    container follows a ``,`` or a ``:``, every container starts with ``{`` or ``[`` (inside
    strings they are counted too, so the estimate only errs upwards)."""
    values = data.count(b",") + data.count(b":") + 1
    return (
        data.count(b"{") * _JSON_DICT
        + data.count(b"[") * _JSON_LIST
        + values * _JSON_VALUE
        + len(data)
    )


def check_json(data: bytes, limit: Limits | None = None, stored: int | None = None) -> None:
    """``InputRefused`` when parsing ``data`` as JSON would take more than ``parsed_bytes``
    (or ``per_stored_byte`` times ``stored``, the file's size on disk, when larger)."""
    lim = limit or current()
    cap = lim.parsed_cap(len(data) if stored is None else stored)
    need = json_parsed_bytes(data)
    if need > cap:
        raise exceeded(f"JSON would take about {size_text(need)} once parsed", "parsed_bytes", cap)
