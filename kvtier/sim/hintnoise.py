"""Wrong hints on purpose: how a hint-aware policy behaves when the engine is mistaken.

:func:`corrupt_hints` returns a copy of a trace in which a chosen share of the hints say
the wrong thing, drawn with a seeded generator:

* a ``next_turn`` becomes a ``close`` (the session was said to end, it comes back) or
  keeps its kind with a gap 20x too short or too long;
* a ``close`` becomes a ``next_turn`` with a gap drawn like the trace's own gaps (the
  session was said to continue, it never does);
* a ``pin`` pins the pages of another hint instead (the wrong prompt stays);
* ``open``, ``ttl`` and ``priority`` get a value (or keys) from another hint.

The other hints are left as they were, so ``share=0.5`` means "half of the hints are
wrong".
"""

from __future__ import annotations

import random

from kvtier.errors import KVTierUsageError
from kvtier.policy.hints import Hint
from kvtier.sim.trace import Trace, TraceHint


def corrupt_hints(trace: Trace, share: float, seed: int = 0) -> Trace:
    """``trace`` with ``share`` of its hints wrong (see the module docstring). Raises
    :class:`KVTierUsageError` for a share outside [0, 1]."""
    if not 0.0 <= share <= 1.0:
        raise KVTierUsageError(f"hint corruption share must lie in [0, 1], got {share!r}")
    rng = random.Random(seed)
    gaps = [h.hint.value for h in trace.hints if h.hint.kind == "next_turn"]
    gaps = [g for g in gaps if g is not None] or [60.0]
    out: list[TraceHint] = []
    hints = trace.hints
    for th in hints:
        h = th.hint
        if rng.random() >= share:
            out.append(th)
            continue
        other = hints[rng.randrange(len(hints))].hint
        if h.kind == "next_turn":
            assert h.value is not None
            if rng.random() < 0.5:
                wrong = Hint("close", h.keys)
            else:
                factor = 20.0 if rng.random() < 0.5 else 1 / 20.0
                wrong = Hint("next_turn", h.keys, h.value * factor)
        elif h.kind == "close":
            wrong = Hint("next_turn", h.keys, rng.choice(gaps))
        elif h.kind == "pin":
            wrong = Hint("pin", other.keys)
        elif h.kind in ("ttl", "priority") and h.value is not None:
            wrong = Hint(h.kind, h.keys, h.value * (20.0 if rng.random() < 0.5 else 1 / 20.0))
        else:
            wrong = Hint(h.kind, other.keys, h.value)
        out.append(TraceHint(th.before, th.timestamp_s, wrong))
    return Trace(trace.name, trace.block_tokens, trace.requests, out)
