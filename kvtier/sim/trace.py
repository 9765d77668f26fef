"""Request traces: what a replay feeds through the tiers.

A :class:`Trace` is a time-ordered list of :class:`Request` objects, each naming the
blocks (pages) of its prompt in order. Block ids of public traces are remapped hashes of a
block together with every block before it, exactly like kvtier's page keys, so a shared
id means a shared prefix. Readers turn them into :data:`~kvtier.keys.PageKey` values
(16 bytes, the id little-endian), so the replay drives the very policy objects a live
tier uses.

Readers:

* :func:`read_mooncake` - Mooncake FAST'25 JSONL (``timestamp`` ms, ``input_length``,
  ``output_length``, ``hash_ids``).
* :func:`read_azure_arrivals` - the Azure LLM inference CSVs (arrival times and lengths
  only, no prefix information): used as arrival processes for synthetic workloads.

Both read plain or gzip-compressed files (``.gz``, recognised by content) and raise
:class:`~kvtier.errors.KVTierUsageError` naming the file and line of a bad row, and for a
file that is missing, not a file, not UTF-8 text, or holds no request.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import json
import math
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from kvtier.errors import KVTierUsageError
from kvtier.keys import KEY_BYTES, PageKey
from kvtier.policy.hints import Hint, parse_hint

#: Block ids become 16-byte page keys: they lie in ``[0, BLOCK_ID_LIMIT)`` (2**128).
BLOCK_ID_LIMIT = 1 << (8 * KEY_BYTES)

#: Token counts of a request lie in ``[0, MAX_TOKENS]`` (the replay keeps them as int64).
MAX_TOKENS = 2**63 - 1


def _brief(value: object) -> str:
    """``repr(value)`` for an error message, a huge integer shortened to its first digits
    and its length."""
    text = repr(value)
    if isinstance(value, int) and len(text) > 40:
        return f"{text[:20]}... ({len(text.lstrip('-'))} digits)"
    return text


def block_key(block_id: int) -> PageKey:
    """The page key standing for trace block ``block_id`` (16 bytes, little-endian).
    Raises :class:`KVTierUsageError` unless ``0 <= block_id < 2**128``."""
    if not 0 <= block_id < BLOCK_ID_LIMIT:
        raise KVTierUsageError(
            f"block ids must lie in [0, 2**{8 * KEY_BYTES}) (they become {KEY_BYTES}-byte "
            f"page keys), got {_brief(block_id)}"
        )
    return PageKey(block_id.to_bytes(KEY_BYTES, "little"))


def key_block(key: PageKey) -> int:
    """Inverse of :func:`block_key`."""
    return int.from_bytes(key, "little")


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace.

    Attributes:
        timestamp_s: arrival time in seconds since the trace start.
        input_tokens: prompt length in tokens.
        output_tokens: generated tokens.
        blocks: page keys of the prompt's blocks, in order (the last one may be partial).
        last_partial: whether the last block holds fewer than ``block_tokens`` tokens
            (such a block gets no page key in a live kvtier: it is never shared).
    """

    timestamp_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[PageKey, ...]
    last_partial: bool = False


@dataclass(frozen=True, slots=True)
class TraceHint:
    """An engine hint in a trace, given before request number ``before`` (so after every
    earlier request), at ``timestamp_s``."""

    before: int
    timestamp_s: float
    hint: Hint


@dataclass
class Trace:
    """A named, time-ordered request list with its block size in tokens, and the engine
    hints that came with it (``hints``, ordered by ``before``; empty for public traces)."""

    name: str
    block_tokens: int
    requests: list[Request] = field(default_factory=list)
    hints: list[TraceHint] = field(default_factory=list)
    #: Hint lines read after the last request (dropped: a hint acts on the requests after
    #: it, and none came).
    late_hints: int = 0

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise KVTierUsageError(f"block_tokens must be > 0, got {self.block_tokens}")

    @property
    def total_refs(self) -> int:
        """Block references over all requests."""
        return sum(len(r.blocks) for r in self.requests)

    def distinct_blocks(self) -> int:
        """Number of distinct blocks referenced."""
        seen: set[PageKey] = set()
        for r in self.requests:
            seen.update(r.blocks)
        return len(seen)

    @property
    def duration_s(self) -> float:
        """Time from the first to the last arrival."""
        if not self.requests:
            return 0.0
        return self.requests[-1].timestamp_s - self.requests[0].timestamp_s

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (and the hints given before them) as a new trace."""
        hints = [h for h in self.hints if h.before < n]
        return Trace(f"{self.name}[:{n}]", self.block_tokens, self.requests[:n], hints)

    def without_hints(self) -> Trace:
        """The same requests with no hints."""
        return Trace(self.name, self.block_tokens, self.requests)

    def slice(self, start: int, stop: int, name: str | None = None) -> Trace:
        """Requests ``start`` to ``stop`` (and their hints) as a new trace."""
        hints = [
            TraceHint(h.before - start, h.timestamp_s, h.hint)
            for h in self.hints
            if start <= h.before < stop
        ]
        return Trace(
            name or f"{self.name}[{start}:{stop}]",
            self.block_tokens,
            self.requests[start:stop],
            hints,
        )


def requests_from_ids(
    rows: Iterable[tuple[float, int, int, list[int]]], block_tokens: int
) -> list[Request]:
    """Build requests from ``(timestamp_s, input_tokens, output_tokens, block ids)`` rows."""
    cache: dict[int, PageKey] = {}
    out: list[Request] = []
    for ts, n_in, n_out, ids in rows:
        keys: list[PageKey] = []
        for b in ids:
            k = cache.get(b)
            if k is None:
                k = cache[b] = block_key(b)
            keys.append(k)
        out.append(Request(ts, n_in, n_out, tuple(keys), n_in % block_tokens != 0))
    return out


_REQUEST_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _check_request_fields(row: dict[str, object], where: str) -> None:
    """Name the fields a request line lacks (rather than call a missing one ill-typed)."""
    missing = [f for f in _REQUEST_FIELDS if f not in row]
    if missing:
        names = ", ".join(repr(f) for f in missing)
        raise KVTierUsageError(
            f"{where}: missing field{'s' if len(missing) > 1 else ''} {names} (a Mooncake "
            f"request line has {', '.join(_REQUEST_FIELDS)}; a hint line has 'hint')"
        )


def _int_field(row: dict[str, object], name: str, where: str) -> int:
    value = row.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
        raise KVTierUsageError(
            f"{where}: field {name!r} must be an integer from 0 to 2**63 - 1, got {_brief(value)}"
        )
    return value


def _block_ids(row: dict[str, object], where: str) -> list[int]:
    ids = row.get("hash_ids")
    if not isinstance(ids, list):
        raise KVTierUsageError(
            f"{where}: field 'hash_ids' must be a list of ints >= 0, got {type(ids).__name__}"
        )
    for i, b in enumerate(ids):
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise KVTierUsageError(
                f"{where}: field 'hash_ids' must be a list of ints >= 0, entry {i} is {_brief(b)}"
            )
    big = next((b for b in ids if b >= BLOCK_ID_LIMIT), None)
    if big is not None:
        raise KVTierUsageError(
            f"{where}: field 'hash_ids': block id {_brief(big)} is not below 2**{8 * KEY_BYTES} "
            f"(block ids become {KEY_BYTES}-byte page keys)"
        )
    return ids


def _timestamp_s(row: dict[str, object], where: str) -> float:
    """The line's ``timestamp`` (ms) in seconds: a finite number >= 0."""
    ts = row.get("timestamp")
    if ts is None and "timestamp" not in row:
        raise KVTierUsageError(f"{where}: missing field 'timestamp' (ms since the trace start)")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KVTierUsageError(
            f"{where}: field 'timestamp' must be a number of ms, got {_brief(ts)}"
        )
    try:
        t_s = float(ts) / 1000.0
    except OverflowError:  # an integer beyond the float range
        t_s = math.inf
    if not math.isfinite(t_s):
        raise KVTierUsageError(
            f"{where}: field 'timestamp' must be a finite number of ms, got {_brief(ts)}"
        )
    if t_s < 0:
        raise KVTierUsageError(
            f"{where}: field 'timestamp' must not be negative (ms since the trace start), "
            f"got {_brief(ts)}"
        )
    return t_s


def _json_line(line: str, where: str) -> dict[str, object]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise KVTierUsageError(f"{where}: invalid JSON: {exc.msg}") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise KVTierUsageError(f"{where}: unreadable number: {str(exc).split(';')[0]}") from None
    except RecursionError:
        raise KVTierUsageError(f"{where}: invalid JSON: nested too deeply") from None
    if not isinstance(row, dict):
        raise KVTierUsageError(f"{where}: expected a JSON object per line")
    return row


@contextlib.contextmanager
def open_trace(path: str | Path, what: str = "trace") -> Iterator[io.TextIOBase]:
    """``path`` opened as UTF-8 text, through gzip when it is compressed (by its first
    bytes, whatever its name). Errors while reading (not UTF-8, a broken gzip stream)
    become :class:`KVTierUsageError` naming the file."""
    p = Path(path)
    if "\x00" in str(p):
        raise KVTierUsageError(f"{what} path {str(p)!r} contains a NUL byte")
    if not p.is_file():
        raise KVTierUsageError(
            f"{what} file not found: {p}" if not p.exists() else f"{what} {p} is not a file"
        )
    try:
        # utf-8-sig: a byte-order mark (files saved by some Windows editors) is dropped
        with _open_bytes(p) as binary, io.TextIOWrapper(binary, "utf-8-sig", newline="") as text:
            yield text
    except UnicodeDecodeError:
        raise KVTierUsageError(f"{what} {p} is not UTF-8 text ({_first_bad_utf8(p)})") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise KVTierUsageError(f"{what} {p}: broken gzip data: {exc}") from None
    except OSError as exc:
        raise KVTierUsageError(f"{what} {p} cannot be read: {exc.strerror or exc}") from None


def _open_bytes(p: Path) -> gzip.GzipFile | io.BufferedReader:
    """``p`` opened for reading bytes, through gzip when it is compressed (by its first
    bytes, whatever its name)."""
    with p.open("rb") as raw:
        compressed = raw.read(2) == b"\x1f\x8b"
    return gzip.open(p, "rb") if compressed else p.open("rb")


def _first_bad_utf8(p: Path) -> str:
    """Where ``p`` (gzip or plain) first fails to decode as UTF-8: its line and the byte's
    offset in the (uncompressed) file. Reads the whole file: only on the error path."""
    try:
        with _open_bytes(p) as binary:
            data = binary.read()
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = data[: exc.start]
        line = before.count(b"\n") + before.count(b"\r") - before.count(b"\r\n") + 1
        return f"line {line}, byte {exc.start} of the file"
    except (OSError, EOFError, zlib.error):
        pass
    return "a byte that is not UTF-8"


def _trace_name(p: Path) -> str:
    name = p.name
    for suffix in (".gz", ".jsonl", ".json", ".csv"):
        name = name.removesuffix(suffix)
    return name or p.name


def read_mooncake(path: str | Path, block_tokens: int = 512, limit: int | None = None) -> Trace:
    """Read a Mooncake-format JSONL trace.

    Each line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids":
    [...]}``. A line with a ``"hint"`` field is an engine hint instead (kvtier's extension,
    see :mod:`kvtier.policy.hints`): ``{"timestamp": ms, "hint": "next_turn", "hash_ids":
    [...], "value": 42.0}``, given after the requests above it. ``limit`` counts requests.
    Raises :class:`KVTierUsageError` for a missing file, invalid JSON, a missing or
    ill-typed field, a block id of 2**128 or more (it would not fit a page key), a
    timestamp that is not a finite number >= 0, or timestamps that go backwards (naming
    the line). Times are ms since the trace start, so they are never negative: hint-aware
    policies keep a clock that starts at 0 and only moves forward.
    """
    p = Path(path)
    rows: list[tuple[float, int, int, list[int]]] = []
    hint_rows: list[tuple[int, float, Hint]] = []
    last: tuple[float, object] = (0.0, 0)  # seconds, and the timestamp as written
    with open_trace(p) as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            if lineno == 1 and line.lstrip().upper().startswith("TIMESTAMP,"):
                raise KVTierUsageError(
                    f"{where}: this is a CSV (header {line.strip()[:60]!r}), not Mooncake "
                    "JSONL; the Azure LLM traces carry no block ids, so they cannot be "
                    "replayed for hit rates"
                )
            row = _json_line(line, where)
            t_s = _timestamp_s(row, where)
            if t_s < last[0]:
                raise KVTierUsageError(
                    f"{where}: timestamps must not decrease: {_brief(row['timestamp'])} ms "
                    f"after {_brief(last[1])} ms"
                )
            last = (t_s, row["timestamp"])
            if "hint" in row:
                hint_rows.append((len(rows), t_s, parse_hint(row, block_key, where)))
                continue
            _check_request_fields(row, where)
            ids = _block_ids(row, where)
            n_in = _int_field(row, "input_length", where)
            n_out = _int_field(row, "output_length", where)
            rows.append((t_s, n_in, n_out, ids))
    if not rows:
        raise KVTierUsageError(f"trace {p} holds no request (empty file?)")
    hints = [TraceHint(b, t, h) for b, t, h in hint_rows if b < len(rows)]
    requests = requests_from_ids(rows, block_tokens)
    return Trace(_trace_name(p), block_tokens, requests, hints, len(hint_rows) - len(hints))


@dataclass(frozen=True, slots=True)
class Arrival:
    """One arrival of an arrival-process trace (no prefix information)."""

    timestamp_s: float
    context_tokens: int
    generated_tokens: int


def read_azure_arrivals(path: str | Path, limit: int | None = None) -> list[Arrival]:
    """Read an Azure LLM inference CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Timestamps become seconds since the first row. Raises :class:`KVTierUsageError` for a
    missing file, a wrong header or an unparsable row (naming the line).
    """
    p = Path(path)
    out: list[Arrival] = []
    with open_trace(p, "arrival trace") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:3]] != [
            "TIMESTAMP",
            "ContextTokens",
            "GeneratedTokens",
        ]:
            raise KVTierUsageError(
                f"{p}: expected header TIMESTAMP,ContextTokens,GeneratedTokens, got {header}"
            )
        t0: datetime | None = None
        for lineno, row in enumerate(reader, 2):
            if limit is not None and len(out) >= limit:
                break
            try:
                ts = datetime.fromisoformat(row[0][:26])
                ctx, gen = int(row[1]), int(row[2])
            except (ValueError, IndexError) as exc:
                raise KVTierUsageError(f"{p}:{lineno}: bad row {row}: {exc}") from None
            if t0 is None:
                t0 = ts
            out.append(Arrival((ts - t0).total_seconds(), ctx, gen))
    return out
