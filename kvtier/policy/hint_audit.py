"""How often the engine's hints came true, page by page, so a policy can stop following
hints that are often wrong.

:class:`HintAudit` keeps, for each page, the last *checkable* hint given for it:

* ``next_turn`` (and ``open``, with the typical gap of the ``next_turn`` hints so far)
  says the page is used again at ``at``: it comes **true** when the page is referenced in
  the hint's window (from ``at - tolerance`` to ``overdue``, the window in which
  ``hinted`` consumes a prediction) and is **false** when the first reference after
  ``at - tolerance`` comes after the window, or when the window passes with none (noticed
  when the page gets a new hint, or the hint is forgotten). A reference before the
  window judges nothing: other sessions may share the page.
* ``close`` says nothing more comes for the page: it is **false** when the page is
  referenced again. It cannot be proved true in finite time, so it is never counted
  true: an engine that closes correctly is not judged by it, one that closes sessions
  that continue is.

``pin``, ``unpin``, ``ttl`` and ``priority`` are not checked (they state a wish, not a
forecast). Pending hints are kept for ``history`` x the tier's pages (at least 64 pages).
:attr:`accuracy` is the share of judged hints that came true, decayed (``window``
judgements of memory) so an engine that turns unreliable is noticed. On kvtier's session
generators exact hints score 1.0 and half of them wrong (:mod:`kvtier.sim.hintnoise`)
0.17-0.46. Everything is O(1) amortised per event.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.keys import PageKey
from kvtier.policy.hints import Hint

#: A pending hint: (kind, window start, window end); ``close`` has no window.
Pending = tuple[str, float, float]


class HintAudit:
    """The decayed share of a page-level hint's forecasts that came true."""

    def __init__(self, history: float = 4.0, window: float = 4096.0) -> None:
        """``history``: capacities (pages) of hinted pages whose pending hint is kept;
        ``window``: judgements of memory of the decayed counts."""
        self.history = float(history)
        self._keep = 1.0 - 1.0 / float(window)
        self._pending: OrderedDict[PageKey, Pending] = OrderedDict()
        self._typical_gap = 60.0
        self.right = 0.0
        self.wrong = 0.0
        #: Judgements made (not decayed).
        self.judged = 0

    @property
    def accuracy(self) -> float:
        """Share of the judged hints that came true (decayed); 1.0 before any judgement."""
        total = self.right + self.wrong
        return self.right / total if total else 1.0

    def _judge(self, true: bool) -> None:
        self.right *= self._keep
        self.wrong *= self._keep
        if true:
            self.right += 1.0
        else:
            self.wrong += 1.0
        self.judged += 1

    def _settle(self, pending: Pending, now: float) -> None:
        """Judge a hint superseded or forgotten without a reference: a forecast whose
        window passed is false; one whose window is not over, and a close, judge nothing."""
        kind, _, end = pending
        if kind != "close" and end < now:
            self._judge(False)

    def hint(self, hint: Hint, now: float, capacity: int) -> None:
        """Note ``hint`` at ``now``; ``capacity``: the tier's pages."""
        if hint.kind == "close":
            pending: Pending = ("close", 0.0, 0.0)
        elif hint.kind in ("next_turn", "open"):
            gap = self._typical_gap
            if hint.kind == "next_turn" and hint.value is not None:
                gap = hint.value
                self._typical_gap += 0.05 * (gap - self._typical_gap)
            at = now + gap
            pending = ("next", at - (0.1 * gap + 1.0), now + 2 * gap + 1.0)
        else:
            return
        for key in hint.keys:
            old = self._pending.pop(key, None)
            if old is not None:
                self._settle(old, now)
            self._pending[key] = pending
        limit = max(self.history * capacity, 64.0)
        while len(self._pending) > limit:
            _, old = self._pending.popitem(last=False)
            self._settle(old, now)

    def referenced(self, key: PageKey, now: float) -> None:
        """A reference of ``key`` at ``now``: judges its pending hint, if any."""
        pending = self._pending.get(key)
        if pending is None:
            return
        kind, start, end = pending
        if kind == "close":
            self._judge(False)
        elif now < start:
            return  # an earlier use (a page other sessions share too): not this forecast's
        else:
            self._judge(now <= end)
        del self._pending[key]
