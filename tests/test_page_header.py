"""The 64-byte page header every persistent or remote store writes with a page: any
damaged byte of it is a miss. Bytes 60-63 (zero padding, outside the header's own
checksum) were never checked: a docs-only probe flipped each bit there, on NVMe and on
Redis, and the page was still served (and ``inspect store --verify`` passed it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from kvtier.backends.nvme import NvmeStore

from kvtier.errors import IntegrityError
from kvtier.keys import PageKey
from kvtier.pageformat import HEADER_SIZE, MAGIC, encode_header, verify_page

KEY = PageKey(bytes(range(1, 17)))
PAYLOAD = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096].copy()


def test_an_intact_header_verifies() -> None:
    header = encode_header(bytes(KEY), "ns", PAYLOAD)
    assert verify_page(header, bytes(KEY), PAYLOAD).payload_len == PAYLOAD.nbytes


@pytest.mark.parametrize("byte", range(HEADER_SIZE))
@pytest.mark.parametrize("bit", [0, 7])
def test_any_flipped_header_bit_is_refused(byte: int, bit: int) -> None:
    header = bytearray(encode_header(bytes(KEY), "ns", PAYLOAD))
    header[byte] ^= 1 << bit
    with pytest.raises(IntegrityError):
        verify_page(bytes(header), bytes(KEY), PAYLOAD)


async def test_a_flipped_padding_byte_on_disk_is_a_miss(tmp_path: Path) -> None:
    async with NvmeStore(page_bytes=4096, capacity_pages=4, path=tmp_path, engine="posix") as s:
        assert await s.put([KEY], [PAYLOAD]) == [True]
    slab = next((tmp_path / "slabs").iterdir())
    raw = bytearray(slab.read_bytes())
    at = raw.index(MAGIC)  # the header follows the payload in its slot
    raw[at + 61] ^= 0x80
    slab.write_bytes(bytes(raw))
    async with NvmeStore(page_bytes=4096, capacity_pages=4, path=tmp_path, engine="posix") as s:
        out = [np.zeros(4096, np.uint8)]
        assert await s.get([KEY], out) == [False]
