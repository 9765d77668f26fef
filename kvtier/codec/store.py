"""A store tier whose pages are encoded on the way down and decoded on the way up.

:class:`CodecStore` wraps an inner :class:`~kvtier.backend.StoreBackend` and is itself a
store of whole logical pages, so the pipeline, the links and the conformance kit see an
ordinary store. Per page, the inner store holds one *blob*: a codec frame
(:mod:`kvtier.codec.frame`) and the encoded bytes.

* **Sizes.** The inner store is built with ``page_bytes`` = :func:`slot_bytes` (frame +
  the codec's largest encoding). A fixed-size codec (``fp8-e4m3``) fills every slot, so
  the inner store moves and keeps only the encoded bytes. A variable-size codec (``zstd``,
  ``lz4``) hands a store with :attr:`~kvtier.backend.StoreBackend.variable_length` just the
  bytes it produced (``write_blobs`` / ``get_sized``: the file and Redis stores); a
  fixed-slot store (NVMe) gets the blob zero-padded to its slot, so it keeps and reads a
  whole slot and only the codec's CPU time changes.
* **Capacity counts logical pages**: :attr:`capacity_pages` is the inner store's, which
  holds ``capacity bytes // footprint`` slots of ``slot_bytes``, the footprint being the
  backend's :meth:`~kvtier.backend.Backend.page_footprint` (:func:`tier_capacity_pages`;
  on NVMe the slot with its header, 4 KiB-aligned). A tier never holds more bytes than
  configured; ``fp8-e4m3`` doubles the pages a 16-bit tier holds, while a lossless codec
  saves bytes moved and stored but does not raise the page count (its worst case is a
  raw page).
* **Off the event loop, batched.** Encoding and decoding run on this store's executor:
  one hop per batch, a large batch split across its threads (the compressors and numpy
  release the GIL).
* **Never wrong bytes.** Before any decode, the frame's checksum, codec tag, page length,
  encoded length (against the bytes the store returned) and the encoded bytes' checksum
  are verified (the inner store has already checked its own header and checksum over the
  same bytes). A page that fails is a miss, counted (``frame_failures``), logged and
  deleted from the inner store so it can be stored again. A page the codec cannot encode
  (``CodecError``: a lossy codec and a non-finite value) is not written (``False``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from kvtier.backend import Backend, Preflight, Reservation, StoreBackend, check_buffers
from kvtier.codec.base import Codec, CodecError
from kvtier.codec.frame import (
    FLAG_RAW,
    FRAME_SIZE,
    MAX_LENGTH,
    codec_tag,
    verify_frame,
    write_frame,
)
from kvtier.errors import IntegrityError, KVTierUsageError
from kvtier.keys import PageKey

_log = logging.getLogger(__name__)


def slot_bytes(codec: Codec) -> int:
    """Bytes the inner store keeps per page at most: the frame plus the largest
    encoding, or a raw page for a codec that is not fixed-size (it may answer ``None``:
    the page is then stored raw)."""
    return FRAME_SIZE + max(codec.max_encoded_bytes(), 0 if codec.fixed_size else codec.page_bytes)


def tier_capacity_pages(
    capacity_bytes: int, codec: Codec, backend: type[Backend] | None = None
) -> int:
    """Logical pages a tier of ``capacity_bytes`` holds with ``codec``: slots of
    :func:`slot_bytes`, each taking :meth:`~kvtier.backend.Backend.page_footprint` of
    ``backend`` (``slot_bytes`` itself when ``None``)."""
    if backend is None:
        return capacity_bytes // slot_bytes(codec)
    return backend.capacity_pages_for(capacity_bytes, slot_bytes(codec))


class CodecStore(StoreBackend):
    """A codec over an inner store (see the module docstring).

    Args:
        inner: the store that keeps the blobs, not yet opened; its ``page_bytes`` must be
            :func:`slot_bytes` of ``codec``. Opened and closed with this store.
        codec: the codec (built for the model's spec).
        io_threads: worker threads encoding and decoding (default: 2).
    """

    default_io_threads: ClassVar[int] = 2

    def __init__(self, inner: StoreBackend, codec: Codec, *, io_threads: int | None = None):
        if not isinstance(inner, StoreBackend):
            raise KVTierUsageError(
                f"a codec wraps a store backend; {type(inner).__name__} is not one"
            )
        if inner.page_bytes != slot_bytes(codec):
            raise KVTierUsageError(
                f"inner store holds {inner.page_bytes}-byte blobs; codec {codec.name!r} "
                f"needs {slot_bytes(codec)}"
            )
        if codec.page_bytes > MAX_LENGTH:
            raise KVTierUsageError(f"pages of {codec.page_bytes} bytes are too large to frame")
        super().__init__(
            page_bytes=codec.page_bytes, capacity_pages=inner.capacity_pages, io_threads=io_threads
        )
        self.inner = inner
        self.codec = codec
        self.slot = inner.page_bytes
        self._tag = codec_tag(codec.identity)
        #: Hand the inner store only the bytes used (else a zero-padded slot).
        self.sized = inner.variable_length and not codec.fixed_size
        self._counters = {
            "encoded_pages": 0,
            "raw_pages": 0,
            "logical_bytes_written": 0,
            "stored_bytes_written": 0,
            "decoded_pages": 0,
            "stored_bytes_read": 0,
            "encode_failures": 0,
            "frame_failures": 0,
        }

    # -- lifecycle ---------------------------------------------------------------------

    def preflight(self) -> Preflight | None:
        """The inner store's :meth:`~kvtier.backend.Backend.preflight` (its page size is
        the codec's slot size)."""
        return self.inner.preflight()

    async def open(self) -> None:
        """Open the executor and the inner store. Idempotent."""
        if self._opened:
            return
        await super().open()
        try:
            await self.inner.open()
        except BaseException:
            await super().close()
            raise

    async def close(self) -> None:
        """Close the inner store, then the executor. Idempotent."""
        try:
            await self.inner.close()
        finally:
            await super().close()

    # -- encoding ----------------------------------------------------------------------

    def _encode(self, jobs: list[tuple[np.ndarray, np.ndarray]]) -> list[int | str]:
        """Frame and encode each page into its slot buffer; the blob length, or the
        reason it could not be encoded."""
        out: list[int | str] = []
        for page, slot in jobs:
            body = slot[FRAME_SIZE:]
            source = page.view()  # read-only: an encode that wrote to its input changed
            source.flags.writeable = False  # the cache's own copy of the page
            try:
                n = self.codec.encode(source, body)
            except CodecError as exc:
                out.append(str(exc))
                continue
            except Exception as exc:  # a codec bug: this page is not written, others are
                out.append(f"codec {self.codec.name!r} raised {exc!r} (a bug of the codec)")
                continue
            if n is not None and (
                isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(body)
            ):
                out.append(
                    f"codec {self.codec.name!r}: encode returned {n!r}, not a length in "
                    f"[0, {len(body)}] or None (a bug of the codec)"
                )
                continue
            flags = 0
            if n is None or (n >= self.page_bytes and not self.codec.fixed_size):
                body[: self.page_bytes] = page
                n, flags = self.page_bytes, FLAG_RAW
            write_frame(slot, self._tag, flags, n, self.page_bytes)
            used = FRAME_SIZE + n
            if not self.sized and used < self.slot:
                slot[used:] = 0  # a fixed slot: no stale memory on the media
            out.append(used)
        return out

    def _decode(self, jobs: list[tuple[np.ndarray, int, np.ndarray]]) -> list[str | None]:
        """Verify each blob's frame, then decode it into its page buffer; ``None`` when
        it was served, else why not."""
        out: list[str | None] = []
        for blob, length, page in jobs:
            try:
                frame = verify_frame(blob[:length], self._tag, self.page_bytes)
                if frame.raw:
                    page[...] = frame.encoded
                else:
                    self.codec.decode(frame.encoded, page)
            except (IntegrityError, CodecError) as exc:
                out.append(str(exc))
                continue
            except Exception as exc:  # a codec bug: a miss for this page, not the batch
                out.append(f"codec {self.codec.name!r} raised {exc!r} (a bug of the codec)")
                continue
            out.append(None)
        return out

    def round_trip(self, page: Any) -> np.ndarray:
        """The page this tier gives back for ``page`` (``page_bytes`` uint8), encoded and
        decoded by the codec in memory: the page itself for a lossless codec that works,
        what the codec decodes for a lossy one. Raises :class:`CodecError` when the codec
        cannot encode it (such a page is never stored). Runs on the caller's thread (for
        a probe, not for the data path)."""
        (buf,) = check_buffers([page], 1, self.page_bytes)
        out = np.array(buf, copy=True)
        body = np.empty(self.slot - FRAME_SIZE, dtype=np.uint8)
        n = self.codec.encode(buf, body)
        if n is not None:
            self.codec.decode(body[:n], out)
        return out

    # -- the keyed, two-phase interface ------------------------------------------------

    async def reserve(
        self, keys: Sequence[PageKey], namespace: str = ""
    ) -> list[Reservation | None]:
        self._check_open()
        return await self.inner.reserve(keys, namespace)

    async def write(self, reservations: Sequence[Reservation], data: Sequence[Any]) -> list[bool]:
        """Encode the pages (one hop per batch) and write their blobs to the inner
        store; ``False`` for a page the codec cannot encode or the store fails to write."""
        self._check_open()
        bufs = check_buffers(data, len(reservations), self.page_bytes)
        ok = [r.present for r in reservations]
        todo = [i for i, r in enumerate(reservations) if not r.present]
        if not todo:
            return ok
        slots = np.empty((len(todo), self.slot), dtype=np.uint8)
        lengths = await self.run_blocking_chunks(
            self._encode, [(bufs[i], slots[j]) for j, i in enumerate(todo)]
        )
        good: list[tuple[int, np.ndarray]] = []
        for j, (i, n) in enumerate(zip(todo, lengths, strict=True)):
            if isinstance(n, str):
                self._counters["encode_failures"] += 1
                _log.warning("codec %s: page %s not written: %s", self.codec.name,
                             reservations[i].key.hex(), n)  # fmt: skip
                continue
            good.append((i, slots[j, :n] if self.sized else slots[j]))
            self._counters["encoded_pages"] += 1
            self._counters["logical_bytes_written"] += self.page_bytes
            self._counters["stored_bytes_written"] += n
            if n == FRAME_SIZE + self.page_bytes and not self.codec.fixed_size:
                self._counters["raw_pages"] += 1
        if not good:
            return ok
        res = [reservations[i] for i, _ in good]
        blobs = [b for _, b in good]
        if self.sized:
            written = await self.inner.write_blobs(res, blobs)
        else:
            written = await self.inner.write(res, blobs)
        for (i, _), w in zip(good, written, strict=True):
            ok[i] = w
        return ok

    async def commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        self._check_open()
        return await self.inner.commit(reservations)

    async def abort(self, reservations: Sequence[Reservation]) -> None:
        self._check_open()
        await self.inner.abort(reservations)

    async def get(self, keys: Sequence[PageKey], out: Sequence[Any]) -> list[bool]:
        """Read the blobs (one inner call), verify and decode them (one hop per batch);
        ``False`` for a miss. A blob that fails verification or decoding is a miss,
        counted, logged and deleted from the inner store."""
        self._check_open()
        bufs = check_buffers(out, len(keys), self.page_bytes, writable=True)
        ok = [False] * len(keys)
        if not keys:
            return ok
        staging = np.empty((len(keys), self.slot), dtype=np.uint8)
        rows = list(staging)
        lengths = await self.inner.get_sized(keys, rows)
        jobs = [(i, n) for i, n in enumerate(lengths) if n is not None]
        if not jobs:
            return ok
        problems = await self.run_blocking_chunks(
            self._decode, [(rows[i], n, bufs[i]) for i, n in jobs]
        )
        bad: list[PageKey] = []
        for (i, n), problem in zip(jobs, problems, strict=True):
            if problem is None:
                ok[i] = True
                self._counters["decoded_pages"] += 1
                self._counters["stored_bytes_read"] += n
                continue
            self._counters["frame_failures"] += 1
            _log.warning("codec %s: page %s failed verification (%s): a miss, deleted",
                         self.codec.name, keys[i].hex(), problem)  # fmt: skip
            bad.append(keys[i])
        if bad:
            try:
                await self.inner.delete(bad)
            except Exception as exc:  # the misses stand; the store retries on its next read
                _log.warning("codec %s: could not delete %d bad page(s): %r",
                             self.codec.name, len(bad), exc)  # fmt: skip
        return ok

    async def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        self._check_open()
        return await self.inner.contains(keys)

    async def exists(self, keys: Sequence[PageKey]) -> int:
        self._check_open()
        return await self.inner.exists(keys)

    async def delete(self, keys: Sequence[PageKey]) -> list[bool]:
        self._check_open()
        return await self.inner.delete(keys)

    async def keys(self) -> list[PageKey]:
        self._check_open()
        return await self.inner.keys()

    def used_pages(self) -> int:
        return self.inner.used_pages()

    def stats(self) -> dict[str, Any]:
        """The inner store's stats, with this tier's logical page size and capacity, the
        codec, its counters and the observed ratio (logical / stored bytes written)."""
        out = dict(self.inner.stats())
        stored = self._counters["stored_bytes_written"]
        out.update(
            page_bytes=self.page_bytes,
            slot_bytes=self.slot,
            capacity_pages=self.capacity_pages,
            used_pages=self.used_pages(),
            codec=self.codec.describe(),
            codec_ratio=(self._counters["logical_bytes_written"] / stored) if stored else None,
            **self._counters,
        )
        return out


class SharedCodecStore(CodecStore):
    """A :class:`CodecStore` over a shared inner store (a remote pool other servers
    write to): lookups ask it about pages this process has not indexed."""

    shared: ClassVar[bool] = True


def wrap(inner: StoreBackend, codec: Codec, *, io_threads: int | None = None) -> CodecStore:
    """``inner`` behind ``codec`` (shared when ``inner`` is)."""
    cls = SharedCodecStore if inner.shared else CodecStore
    return cls(inner, codec, io_threads=io_threads)
