"""PyTorch Flight Recorder JSON dumps (``_dump_fr_trace_json`` / ``_dump_nccl_trace_json``
output). Same schema as the pickle except: ``process_group`` is a list, the
``time_discovered_*`` of a not-yet-seen state are 0 instead of None, pg_status counters
are strings, and stack frames are absent."""

from __future__ import annotations

import json
from pathlib import Path

from frtools.formats import limits

from .base import DumpError, RankDump, read_content
from .torch_fr import rank_dump

FORMAT = "torch-json"
# Gloo's dumps record ops on groups their pg_config does not list
LISTS_ALL_GROUPS = False


def sniff(path: Path, head: bytes) -> bool:
    text = head.lstrip()
    # nlohmann writes keys sorted, so "entries" is among the first keys
    return text.startswith(b"{") and (b'"entries"' in head or b'"pg_config"' in head)


def read(path: Path) -> RankDump:
    data, stored = read_content(path)
    try:
        limits.check_json(data, stored=stored)
        dump = json.loads(data)
    except limits.InputRefused as e:
        raise DumpError(str(e)) from None
    except UnicodeDecodeError:
        raise DumpError("not UTF-8 text; not a JSON dump") from None
    except RecursionError:
        raise DumpError("JSON nests too deeply to be a dump; refused") from None
    except json.JSONDecodeError as e:
        end = len(data.rstrip())
        if e.pos >= end - 1 or e.msg.startswith("Unterminated"):
            raise DumpError(f"truncated JSON (ends at byte {len(data)} inside the dump)") from None
        raise DumpError(f"invalid JSON: {e}") from None
    except ValueError as e:
        raise DumpError(f"invalid JSON: {e}") from None
    return rank_dump(dump, path, FORMAT)
