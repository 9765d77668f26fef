"""Engine hints through vLLM: a request's ``kv_transfer_params["kvtier"]``.

A client tells kvtier what it knows about a request's KV in the request itself (the
OpenAI API's ``kv_transfer_params`` body field, or ``SamplingParams(extra_args=
{"kv_transfer_params": ...})`` offline)::

    {"kvtier": {"next_turn_s": 30, "priority": 2, "pin_tokens": 512}}

Fields (all optional; see :mod:`kvtier.policy.hints` for what each hint means):

* ``session``: ``"open"`` (more turns will come) or ``"close"`` (the conversation is over:
  its pages are the first to go);
* ``next_turn_s``: the next turn is expected in this many seconds;
* ``ttl_s``: the pages are worth keeping this many seconds, no longer;
* ``priority``: a weight > 0 (1 = normal);
* ``pin_tokens`` / ``unpin_tokens``: pin (unpin) the pages of the first this-many prompt
  tokens (a system prompt; whole pages only);
* ``shared_tokens``: the first this-many tokens are shared with other conversations (a
  system prompt left unpinned): the hints above about *this* conversation skip them.

When the request finishes, the scheduler side sends one :class:`HintRun` per hint to the
workers with the step's metadata. ``pin_tokens`` / ``unpin_tokens`` name the leading whole
pages they cover. Every other hint names the request's whole pages (prompt and generated
tokens: the context its next turn starts with) after the shared prefix, the longest of
``pin_tokens``, ``unpin_tokens`` and ``shared_tokens``, so that closing one conversation
never marks a system prompt that others use as dead. The workers turn runs into
``KVCache.hint`` calls on their own page keys. Hint-aware policies (``hinted``, and
``adaptive`` once hints prove right) act on them; other policies ignore them.

A malformed ``kvtier`` entry never fails the request: :func:`parse_request_hints` raises
:class:`~kvtier.errors.KVTierUsageError` naming the field, and the scheduler logs it,
counts it (``hint_errors``) and serves the request without hints.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier.errors import KVTierUsageError
from kvtier.keys import PageKey
from kvtier.log import get_logger

_log = get_logger("kvtier.vllm.hints")

#: the key of kvtier's entry in a request's ``kv_transfer_params``
PARAMS_KEY = "kvtier"

_SECONDS = {"next_turn_s": "next_turn", "ttl_s": "ttl"}
_TOKENS = {"pin_tokens": "pin", "unpin_tokens": "unpin"}
_FIELDS = ("session", "priority", *_SECONDS, *_TOKENS, "shared_tokens")


@dataclass(frozen=True, slots=True)
class HintRun:
    """A hint ``kind`` (with ``value``) about pages ``[first_page, first_page + pages)``
    of request ``req_id``; travels in :class:`~.metadata.KVTierMetadata`."""

    req_id: str
    kind: str
    first_page: int
    pages: int
    value: float | None = None


@dataclass(frozen=True, slots=True)
class RequestHints:
    """What a request's ``kvtier`` entry asks for: ``(kind, value)`` pairs about its own
    pages (those after the first ``shared`` tokens), and ``(kind, tokens)`` pairs about its
    leading ``tokens`` tokens."""

    whole: tuple[tuple[str, float | None], ...] = ()
    leading: tuple[tuple[str, int], ...] = ()
    shared: int = 0

    def runs(self, req_id: str, pages: int, block_size: int) -> list[HintRun]:
        """The runs for a request with ``pages`` whole pages of ``block_size`` tokens."""
        out: list[HintRun] = []
        for kind, tokens in self.leading:
            n = min(pages, tokens // block_size)
            if n > 0:
                out.append(HintRun(req_id, kind, 0, n))
        first = min(pages, self.shared // block_size)
        if pages > first:
            out.extend(HintRun(req_id, k, first, pages - first, v) for k, v in self.whole)
        return out


def _number(entry: Mapping[str, Any], name: str) -> float:
    v = entry[name]
    try:
        ok = not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)
    except OverflowError:  # an int too large for a float
        ok = False
    if not ok:
        raise KVTierUsageError(
            f"kv_transfer_params.kvtier.{name} must be a finite number, got {v!r:.40}"
        )
    return float(v)


def _tokens(entry: Mapping[str, Any], name: str) -> int:
    v = entry.get(name, 0)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise KVTierUsageError(
            f"kv_transfer_params.kvtier.{name} must be a whole number of tokens >= 0, got {v!r}"
        )
    return v


def parse_request_hints(params: Any) -> RequestHints | None:
    """The hints in ``params`` (a request's ``kv_transfer_params``); ``None`` when it has
    no ``kvtier`` entry. Raises :class:`KVTierUsageError` naming the first bad field."""
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise KVTierUsageError(
            f"kv_transfer_params must be a JSON object, got {type(params).__name__}"
        )
    entry = params.get(PARAMS_KEY)
    if entry is None:
        return None
    if not isinstance(entry, Mapping):
        raise KVTierUsageError(
            f"kv_transfer_params.kvtier must be a JSON object, got {type(entry).__name__}"
        )
    unknown = sorted(str(k) for k in entry if k not in _FIELDS)
    if unknown:
        raise KVTierUsageError(
            f"kv_transfer_params.kvtier: unknown field(s) {', '.join(unknown)}; "
            f"known: {', '.join(_FIELDS)}"
        )
    whole: list[tuple[str, float | None]] = []
    leading: list[tuple[str, int]] = []
    if "session" in entry:
        session = entry["session"]
        if session not in ("open", "close"):
            raise KVTierUsageError(
                f"kv_transfer_params.kvtier.session must be 'open' or 'close', got {session!r}"
            )
        whole.append((session, None))
    for name, kind in _SECONDS.items():
        if name in entry:
            seconds = _number(entry, name)
            if seconds < 0:
                raise KVTierUsageError(
                    f"kv_transfer_params.kvtier.{name} must be >= 0 seconds, got {seconds!r}"
                )
            whole.append((kind, seconds))
    if "priority" in entry:
        weight = _number(entry, "priority")
        if weight <= 0:
            raise KVTierUsageError(
                f"kv_transfer_params.kvtier.priority must be > 0, got {entry['priority']!r}"
            )
        whole.append(("priority", weight))
    shared = _tokens(entry, "shared_tokens")
    for name, kind in _TOKENS.items():
        if name in entry:
            tokens = _tokens(entry, name)
            leading.append((kind, tokens))
            shared = max(shared, tokens)
    if "session" in entry and entry["session"] == "close" and len(whole) > 1:
        raise KVTierUsageError(
            "kv_transfer_params.kvtier: session 'close' ends the conversation; it cannot "
            "come with next_turn_s, ttl_s or priority"
        )
    return RequestHints(tuple(whole), tuple(leading), shared)


#: one ``KVCache.hint`` call: kind, page keys, value
HintCall = tuple[str, list[PageKey], float | None]


class _Hintable(Protocol):
    def hint(self, kind: str, keys: Sequence[PageKey], value: float | None = None) -> None: ...


def hint_calls(
    runs: Sequence[HintRun], keys_of: Callable[[str], Sequence[PageKey]]
) -> list[HintCall]:
    """The ``KVCache.hint`` calls for ``runs`` on a worker: ``keys_of(req_id)`` is the
    request's page keys on this rank; pages a worker does not know are left out."""
    out: list[HintCall] = []
    for run in runs:
        keys = list(keys_of(run.req_id)[run.first_page : run.first_page + run.pages])
        if keys:
            out.append((run.kind, keys, run.value))
    return out


def apply_hints(cache: _Hintable, calls: Sequence[HintCall]) -> None:
    """Make ``calls`` on ``cache`` (on its event loop's thread). Hints are advice: a call
    that fails (the cache closed meanwhile) is logged, never raised."""
    for kind, keys, value in calls:
        try:
            cache.hint(kind, keys, value)
        except Exception as exc:
            _log.warning("a kvtier hint was not applied", kind=kind, error=repr(exc))


async def apply_hints_after(
    cache: _Hintable,
    stores: Sequence[concurrent.futures.Future[Any]],
    calls: Sequence[HintCall],
) -> None:
    """:func:`apply_hints` once every future in ``stores`` (saves submitted to the cache's
    loop) is done, whatever their outcome; run on the cache's loop."""
    if stores:
        await asyncio.gather(*(asyncio.wrap_future(f) for f in stores), return_exceptions=True)
    apply_hints(cache, calls)
