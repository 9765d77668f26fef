"""Bad numbers in a Mooncake JSONL trace: each is refused by the reader with a
:class:`KVTierUsageError` naming the file, the line and the field, and ``kvtier bench sim
--trace`` (also with ``--suite``) exits 2 with that message instead of reporting a kvtier
bug. What real traces hold stays accepted."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from kvtier.cli.app import get_app
from typer.testing import CliRunner

from kvtier.errors import KVTierUsageError
from kvtier.sim.trace import block_key, read_mooncake

BIG_ID = 1361129467683753853853498429727072845824  # > 2**128
FIRST = '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [0]}'


def _request(ts: str, ids: str = "[0]", n_in: str = "512") -> str:
    return f'{{"timestamp": {ts}, "input_length": {n_in}, "output_length": 1, "hash_ids": {ids}}}'


BAD_LINES = [
    # block ids become 16-byte page keys
    (_request("0", f"[0, {BIG_ID}]"), r":1: field 'hash_ids': block id 1361129467683753853853"),
    (
        f'{{"timestamp": 1, "hint": "next_turn", "hash_ids": [{BIG_ID}], "value": 1.0}}',
        r":2: block ids must lie in \[0, 2\*\*128\)",
    ),
    # an integer beyond the float range, and non-finite numbers (JSON's NaN parses)
    (_request("1" + "0" * 400), r":2: field 'timestamp' must be a finite number of ms, got 1"),
    (_request("NaN"), r":2: field 'timestamp' must be a finite number of ms, got nan"),
    (_request("Infinity"), r":2: field 'timestamp' must be a finite number of ms, got inf"),
    (_request("-Infinity"), r":2: field 'timestamp' must be a finite number of ms, got -inf"),
    (_request("-5000"), r":2: field 'timestamp' must not be negative .*got -5000"),
    (
        '{"timestamp": 1, "hint": "next_turn", "hash_ids": [0], "value": 1' + "0" * 400 + "}",
        r":2: hint 'next_turn': value is an integer too large for a float \(401 digits\)",
    ),
    (_request("0", n_in="1" + "0" * 30), r":2: field 'input_length' must be an integer from 0"),
    (_request("1" + "0" * 5000), r":2: unreadable number: Exceeds the limit \(4300 digits\)"),
    (_request("0", "[" * 100_000 + "]" * 100_000), r":2: invalid JSON: nested too deeply"),
    # a missing field is named as missing (it was "must be an integer ..., got None")
    ('{"timestamp": 1, "input_length": 5, "hash_ids": [0]}', r":2: missing field 'output_length'"),
    ('{"timestamp": 1, "input_length": 5}', r":2: missing fields 'output_length', 'hash_ids'"),
    ('{"input_length": 5, "output_length": 1}', r":2: missing field 'timestamp'"),
    # a hint line without the pages it names (accepted before, as a hint on nothing)
    ('{"timestamp": 1, "hint": "close"}', r":2: missing field 'hash_ids' \(the pages the hint"),
]


@pytest.mark.parametrize(("line", "match"), BAD_LINES, ids=range(len(BAD_LINES)))
def test_bad_numbers_are_named_by_file_and_line(tmp_path: Path, line: str, match: str) -> None:
    f = tmp_path / "t.jsonl"
    first = "" if ":1:" in match else FIRST + "\n"
    f.write_text(first + line + "\n" + _request("9000") + "\n")
    with pytest.raises(KVTierUsageError, match=r"t\.jsonl" + match):
        read_mooncake(f)


def test_a_negative_first_timestamp_is_named_as_negative(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text(_request("-5000") + "\n" + _request("0") + "\n")
    with pytest.raises(KVTierUsageError, match=r"t\.jsonl:1: field 'timestamp' must not be neg"):
        read_mooncake(f)


def test_time_cannot_go_back_after_a_nan(tmp_path: Path) -> None:
    """Before: NaN compared false against everything, so the line after it could go back
    in time unnoticed."""
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join([_request("1000"), _request("NaN"), _request("10")]) + "\n")
    with pytest.raises(KVTierUsageError, match=r":2: field 'timestamp' must be a finite"):
        read_mooncake(f)
    f.write_text("\n".join([_request("1000"), _request("10")]) + "\n")
    with pytest.raises(KVTierUsageError, match=r":2: timestamps must not decrease: 10 ms after"):
        read_mooncake(f)


def test_what_real_traces_hold_is_accepted(tmp_path: Path) -> None:
    """The largest id, a length that does not match the ids, duplicate ids in a request,
    equal timestamps and float ones."""
    f = tmp_path / "t.jsonl"
    top = 2**128 - 1
    f.write_text(
        "\n".join(
            [
                _request("0", f"[0, {top}]", n_in="7"),
                _request("0.5", "[0, 0, 3]", n_in="5000"),
                _request("0.5"),
            ]
        )
        + "\n"
    )
    tr = read_mooncake(f)
    assert tr.requests[0].blocks[1] == block_key(top) == b"\xff" * 16
    assert [len(r.blocks) for r in tr.requests] == [2, 3, 1]
    assert tr.requests[2].timestamp_s == 0.0005


def test_block_key_refuses_an_id_beyond_a_page_key() -> None:
    with pytest.raises(KVTierUsageError, match=r"block ids must lie in \[0, 2\*\*128\)"):
        block_key(2**128)
    with pytest.raises(KVTierUsageError, match=r"got -1"):
        block_key(-1)


@pytest.mark.parametrize("suite", [False, True], ids=["sim", "suite"])
@pytest.mark.parametrize(
    "line", [BAD_LINES[0][0], BAD_LINES[2][0], BAD_LINES[3][0]], ids=["id", "huge-ms", "nan"]
)
def test_bench_sim_exits_2_naming_the_line(tmp_path: Path, line: str, suite: bool) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text(FIRST + "\n" + line + "\n")
    args = ["bench", "sim", "--trace", str(f), "--no-progress", "--json"]
    result = CliRunner().invoke(get_app(), [*args, "--suite"] if suite else args)
    assert result.exit_code == 2, result.output
    error = json.loads(result.stdout)["error"]
    assert "t.jsonl:2: " in error["message"] and "kvtier bug" not in result.output


@pytest.mark.parametrize("compress", [False, True])
def test_a_byte_that_is_not_utf8_is_named_by_line(tmp_path: Path, compress: bool) -> None:
    """The line of the first byte that is not UTF-8, and its offset in the file (it was
    the offset inside the decoder's chunk, with no line)."""
    good = b'{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n'
    data = good * 300 + good[:-1] + b"\xff\n"
    path = tmp_path / ("t.jsonl.gz" if compress else "t.jsonl")
    path.write_bytes(gzip.compress(data) if compress else data)
    where = f"line 301, byte {300 * len(good) + len(good) - 1} of the file"
    with pytest.raises(KVTierUsageError, match=f"is not UTF-8 text \\({where}\\)"):
        read_mooncake(path)
