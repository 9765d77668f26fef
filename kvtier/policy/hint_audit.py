"""How often the engine's hints came true, page by page, so a policy can stop following
hints that are often wrong.

:class:`HintAudit` keeps, for each page its tier holds when the hint comes, the last
*checkable* hint given for it, and judges it by the page's next reference the tier sees:

* ``next_turn`` (and ``open``, with the typical gap of the ``next_turn`` hints so far)
  says the page is used again at ``at``: **true** when the reference falls in the hint's
  window (from ``at - tolerance`` to ``overdue``: :class:`~kvtier.policy.hints.NextUse`,
  the window in which ``hinted`` consumes a prediction), **false** when it comes after
  the window. A reference before the window judges nothing (other sessions may share the
  page).
* ``close`` says nothing more comes for the page: **false** when it is referenced again.

Nothing is judged without a reference the tier saw: a hint superseded by a newer one for
the page, forgotten (``history`` x the tier's pages of newer hinted pages, at least 64),
or a ``next_turn`` whose page left the tier (:meth:`forget`) is dropped unjudged (a
``close`` stays pending after its page left: the page referenced again, held or not,
proves it wrong). A tier below another
sees only the references the upper one does not serve, so silence proves nothing; and a
close, which only time could prove true, is never counted true. ``pin``, ``unpin``,
``ttl`` and ``priority`` are not checked (they state a wish, not a forecast).

:attr:`accuracy` is the share of judged hints that came true, decayed (``window``
judgements of memory) so an engine that turns unreliable is noticed. On kvtier's session
generators (one tier at 1 %) exact hints score 1.0 and half of them wrong
(:mod:`kvtier.sim.hintnoise`) 0.2-0.5. Everything is O(1) amortised per event.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvtier.keys import PageKey
from kvtier.policy.hints import Hint, NextUse

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
        self._next_use = NextUse()
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

    def hint(self, hint: Hint, now: float, capacity: int, held: Container[PageKey]) -> None:
        """Note ``hint`` at ``now`` for its pages in ``held`` (the tier's pages);
        ``capacity``: the tier's size in pages."""
        use = self._next_use.window(hint, now)
        if hint.kind == "close":
            pending: Pending = ("close", 0.0, 0.0)
        elif use is not None:
            at, overdue, tolerance = use
            pending = ("next", at - tolerance, overdue)
        else:
            return
        for key in hint.keys:
            if key in held:
                self._pending.pop(key, None)
                self._pending[key] = pending
        limit = max(self.history * capacity, 64.0)
        while len(self._pending) > limit:
            self._pending.popitem(last=False)

    def forget(self, key: PageKey) -> None:
        """The page left the tier: its pending ``next_turn`` is dropped unjudged (a tier
        may never see the reference that proves it); a pending ``close`` stays, since any
        later reference of the page proves it wrong (the session it ended came back)."""
        pending = self._pending.get(key)
        if pending is not None and pending[0] != "close":
            del self._pending[key]

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
