"""A hypothesis state machine that drives a backend against a model of the contract.

Random sequences of reserve / write / commit / abort / put / delete / get over a handful
of keys, on a backend with room for fewer pages than there are keys, checked step by step
against a dict model: committed bytes, visibility, ``exists`` prefixes and ``used_pages``.
Needs ``hypothesis`` (a dev dependency). Usage in a test module::

    TestDram = backend_state_machine(
        lambda: DramArena(page_bytes=64, capacity_pages=4)
    ).TestCase
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.backend import Backend, Reservation
from kvtier.keys import PageKey
from kvtier.testing.kit import BackendFactory, ConformanceError, build

T = TypeVar("T")

#: How many distinct keys the machine plays with.
KEY_COUNT = 6


@dataclass
class _Pending:
    reservation: Reservation
    data: bytes | None = None


def _page(page_bytes: int, key_index: int, fill: int) -> np.ndarray:
    page = np.full(page_bytes, fill, dtype=np.uint8)
    page[0] = key_index
    return page


def _check(cond: object, what: str) -> None:
    if not cond:
        raise ConformanceError(what)


def backend_state_machine(
    factory: BackendFactory, *, max_examples: int = 25, steps: int = 30
) -> type[RuleBasedStateMachine]:
    """A state machine class for backends from ``factory`` (its ``.TestCase`` is a
    unittest/pytest test). Each example opens a fresh backend and empties it first."""

    keys = [PageKey(bytes([i + 1]) * 16) for i in range(KEY_COUNT)]
    key_ix = st.integers(0, KEY_COUNT - 1)

    @settings(max_examples=max_examples, stateful_step_count=steps, deadline=None)
    class BackendMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.backend: Backend = self.run(self._open())
            #: key -> the bytes a get may serve (one set per key: racing commits allow either)
            self.committed: dict[PageKey, frozenset[bytes]] = {}
            self.pending: list[_Pending] = []

        def run(self, coro: Coroutine[Any, Any, T]) -> T:
            return self.loop.run_until_complete(coro)

        async def _open(self) -> Backend:
            b = await build(factory)
            await b.open()
            old = await b.keys()
            if old:
                await b.delete(old)
            return b

        def teardown(self) -> None:
            self.run(self.backend.close())
            self.loop.close()

        @property
        def pb(self) -> int:
            return self.backend.page_bytes

        @rule(i=key_ix)
        def reserve(self, i: int) -> None:
            key = keys[i]
            free = self.backend.used_pages() < self.backend.capacity_pages
            (r,) = self.run(self.backend.reserve([key]))
            if key in self.committed:
                _check(r is not None and r.present, "reserve of a committed key not 'present'")
            elif free:
                _check(r is not None and not r.present, "reserve with room answered None")
                assert r is not None
                self.pending.append(_Pending(r))
            else:
                _check(r is None, "reserve when full did not answer None")

        @precondition(lambda self: any(p.data is None for p in self.pending))
        @rule(data=st.data(), fill=st.integers(0, 255))
        def write(self, data: st.DataObject, fill: int) -> None:
            unwritten = [p for p in self.pending if p.data is None]
            p = data.draw(st.sampled_from(unwritten))
            page = _page(self.pb, keys.index(p.reservation.key), fill)
            ok = self.run(self.backend.write([p.reservation], [page]))
            _check(ok == [True], "write into a live reservation failed")
            p.data = page.tobytes()

        @precondition(lambda self: any(p.data is not None for p in self.pending))
        @rule(data=st.data())
        def commit(self, data: st.DataObject) -> None:
            written = [p for p in self.pending if p.data is not None]
            p = data.draw(st.sampled_from(written))
            ok = self.run(self.backend.commit([p.reservation]))
            _check(ok == [True], "commit of a written reservation failed")
            self.pending.remove(p)
            assert p.data is not None
            key = p.reservation.key
            if key in self.committed:  # a racing commit: either write's bytes may stay
                self.committed[key] = self.committed[key] | {p.data}
            else:
                self.committed[key] = frozenset({p.data})

        @precondition(lambda self: bool(self.pending))
        @rule(data=st.data())
        def abort(self, data: st.DataObject) -> None:
            p = data.draw(st.sampled_from(self.pending))
            self.run(self.backend.abort([p.reservation]))
            self.pending.remove(p)

        @rule(i=key_ix, fill=st.integers(0, 255))
        def put(self, i: int, fill: int) -> None:
            key = keys[i]
            free = self.backend.used_pages() < self.backend.capacity_pages
            page = _page(self.pb, i, fill)
            ok = self.run(self.backend.put([key], [page]))
            if key in self.committed or free:
                _check(ok == [True], "put with room (or of a committed key) failed")
                self.committed.setdefault(key, frozenset({page.tobytes()}))
            else:
                _check(ok == [False], "put when full succeeded")

        @rule(i=key_ix)
        def delete(self, i: int) -> None:
            key = keys[i]
            ok = self.run(self.backend.delete([key]))
            _check(ok == [key in self.committed], "delete answered wrong")
            self.committed.pop(key, None)

        @rule(picks=st.lists(key_ix, max_size=KEY_COUNT))
        def get(self, picks: list[int]) -> None:
            chosen = [keys[i] for i in picks]
            out = [np.zeros(self.pb, dtype=np.uint8) for _ in chosen]
            ok = self.run(self.backend.get(chosen, out))
            _check(ok == [k in self.committed for k in chosen], "get hits differ from model")
            for k, hit, buf in zip(chosen, ok, out, strict=True):
                if hit:
                    got = buf.tobytes()
                    _check(got in self.committed[k], "get returned wrong bytes")
                    self.committed[k] = frozenset({got})  # served once: it must stay

        @invariant()
        def visibility_and_space(self) -> None:
            present = self.run(self.backend.contains(keys))
            _check(present == [k in self.committed for k in keys], "contains() differs")
            listed = self.run(self.backend.keys())
            _check(set(listed) == set(self.committed), "keys() differs from the model")
            prefix = 0
            while prefix < len(keys) and keys[prefix] in self.committed:
                prefix += 1
            _check(self.run(self.backend.exists(keys)) == prefix, "exists() prefix differs")
            want = len(self.committed) + len(self.pending)
            _check(self.backend.used_pages() == want, "used_pages() differs from the model")

    return BackendMachine
