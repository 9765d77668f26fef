"""``kvtier bench codec``: encode/decode speed and ratio per codec, and the effective GB/s
of store tiers with each codec beside the same tier without one."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import typer
from kvtier.cli.app import bench_app
from kvtier.cli.output import console, emit, run_guarded, table

from kvtier.bench.codec import (
    DEFAULT_CODECS,
    check_throughput_tiers,
    codec_speed,
    parse_codec,
    tier_throughput,
)
from kvtier.bench.kvpages import SOURCES, kv_pages
from kvtier.config import format_size
from kvtier.errors import KVTierUsageError


def _render(data: dict[str, Any]) -> None:
    speed = data["speed"]
    console.print(
        f"KV: {data['source']} ({data['dtype']}, {speed['pages']} pages of "
        f"{format_size(speed['page_bytes'])}); memcpy {speed['memcpy_gbps']:.2f} GB/s",
        highlight=False,
        markup=False,
    )
    rows = [
        (
            r["codec"],
            r["ratio"],
            r["encode_gbps"],
            r["decode_gbps"],
            "yes" if r["exact"] else f"no (max {r.get('max_error_of_peak', 0):.3g} of peak)",
        )
        for r in speed["codecs"]
    ]
    console.print(
        table(
            "codec speed, one thread (GB/s of page bytes)",
            ["codec", "ratio", "encode", "decode", "exact"],
            rows,
        )
    )
    for tier in data["tiers"]:
        tier_rows = [
            (
                r["codec"],
                r["stored_bytes_per_page"],
                r["write_gbps"],
                r["write_vs_none"],
                r["read_gbps"],
                r["read_vs_none"],
            )
            for r in tier["codecs"]
        ]
        console.print(
            table(
                f"{tier['backend']} tier, {tier['pages']} pages, batches of "
                f"{tier['batch_pages']}, median of {tier['rounds']} (logical GB/s)",
                ["codec", "stored B/page", "write", "vs none", "read", "vs none"],
                tier_rows,
            )
        )


@bench_app.command("codec")
def codec(
    source: Annotated[str, typer.Option(help=f"KV pages from: {', '.join(SOURCES)}")] = "normal",
    dtype: Annotated[str, typer.Option(help="KV dtype: bfloat16, float16, float32")] = "bfloat16",
    page_tokens: Annotated[int, typer.Option(help="tokens per page")] = 16,
    pages: Annotated[int, typer.Option(help="pages (normal, random-llama sources)")] = 48,
    codec_opt: Annotated[
        list[str] | None,
        typer.Option("--codec", help="codec[:key=value,...] (repeat; default: a built-in set)"),
    ] = None,
    tier: Annotated[
        list[str] | None, typer.Option(help="also measure a tier: file, nvme, redis (repeat)")
    ] = None,
    batch_pages: Annotated[int, typer.Option(help="pages per tier call")] = 16,
    rounds: Annotated[int, typer.Option(help="alternating rounds per tier (median)")] = 3,
    repeat: Annotated[int, typer.Option(help="timings per codec (best)")] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object on stdout")] = False,
) -> None:
    """Codec ratio and speed on KV pages, and tier GB/s with each codec vs none."""

    def body() -> None:
        for flag, value in (("--pages", pages), ("--repeat", repeat), ("--rounds", rounds),
                            ("--batch-pages", batch_pages)):  # fmt: skip
            if value < 1:
                raise KVTierUsageError(f"{flag} must be >= 1, got {value}")
        check_throughput_tiers(tier or [])
        codecs = [parse_codec(c) for c in codec_opt] if codec_opt else DEFAULT_CODECS
        spec, kv, description = kv_pages(source, dtype=dtype, page_tokens=page_tokens, pages=pages)
        report: dict[str, Any] = {
            "source": description,
            "dtype": dtype,
            "spec": spec.to_dict(),
            "speed": codec_speed(spec, kv, codecs, repeat),
            "tiers": [
                asyncio.run(
                    tier_throughput(spec, kv, t, codecs, batch_pages=batch_pages, rounds=rounds)
                )
                for t in tier or []
            ],
        }
        emit(report, as_json, _render)

    run_guarded(body, as_json)
