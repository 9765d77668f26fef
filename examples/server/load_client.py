"""A load client for the example server: multi-turn conversations, trace-timed arrivals.

    python examples/server/load_client.py --url http://127.0.0.1:8080 \\
        --conversations 8 --turns 4 [--trace ../shared/traces/azure_llm_2023_conv.csv] \\
        [--time-scale 0.05] [--verify]

Each conversation opens with a system prompt shared by all conversations, then each
turn sends the whole history plus new user tokens and appends the answer, as a chat
front-end does; so from the second turn on a prompt's prefix was computed before. Turn
sizes and arrival times come from the Azure LLM inference trace (conversation workload:
``TIMESTAMP,ContextTokens,GeneratedTokens``) when given, scaled down for a small model;
without a trace, sizes are drawn from a seeded generator and turns arrive back to back.
A turn never starts before the previous turn of its conversation has answered.

``--verify`` sends every turn a second time with ``use_cache: false`` and checks the
answers are identical. Prints one JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp


@dataclass(frozen=True)
class TurnPlan:
    """One planned turn: when it may start (seconds from the run's start) and its sizes."""

    at_s: float
    user_tokens: int
    answer_tokens: int


@dataclass
class TurnResult:
    """What one turn got back."""

    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    seconds: float
    answer: list[int] = field(repr=False)
    verified: bool | None = None


def read_trace(path: Path, rows: int) -> list[tuple[float, int, int]]:
    """The first ``rows`` rows of an Azure LLM trace as (seconds from first, context,
    generated). Raises ``ValueError`` naming the file when it is not such a trace."""
    out: list[tuple[float, int, int]] = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if not need <= set(reader.fieldnames or ()):
            raise ValueError(f"{path}: expected columns {sorted(need)}, got {reader.fieldnames}")
        first: datetime | None = None
        for row in reader:
            ts = datetime.fromisoformat(row["TIMESTAMP"][:26])
            first = first or ts
            out.append(
                (
                    (ts - first).total_seconds(),
                    int(row["ContextTokens"]),
                    int(row["GeneratedTokens"]),
                )
            )
            if len(out) == rows:
                break
    if len(out) < rows:
        raise ValueError(f"{path}: {len(out)} rows, {rows} needed")
    return out


def plan(
    conversations: int,
    turns: int,
    trace: Path | None,
    time_scale: float,
    token_scale: int,
    max_user: int,
    max_answer: int,
    seed: int,
) -> list[list[TurnPlan]]:
    """Per conversation, its turns. Trace row ``c + t * conversations`` times turn ``t`` of
    conversation ``c`` (rows interleave conversations as a busy service sees them)."""
    if conversations < 1 or turns < 1:
        raise ValueError("conversations and turns must be >= 1")
    rng = random.Random(seed)
    rows = read_trace(trace, conversations * turns) if trace is not None else None
    out: list[list[TurnPlan]] = []
    for c in range(conversations):
        conv = []
        for t in range(turns):
            if rows is not None:
                at, ctx, gen = rows[c + t * conversations]
                user = max(4, min(max_user, ctx // token_scale))
                answer = max(2, min(max_answer, gen // token_scale))
                conv.append(TurnPlan(at * time_scale, user, answer))
            else:
                conv.append(TurnPlan(0.0, rng.randint(4, max_user), rng.randint(2, max_answer)))
        out.append(conv)
    return out


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with session.post(f"{url}/generate", json=body) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"server answered {r.status}: {data}")
        return data


async def play(
    url: str,
    plans: list[list[TurnPlan]],
    vocab: int,
    system_tokens: int = 32,
    verify: bool = False,
    seed: int = 0,
) -> list[TurnResult]:
    """Play every conversation concurrently; returns the turns in completion order."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(system_tokens)]
    results: list[TurnResult] = []
    start = time.perf_counter()

    async def conversation(c: int, turns: list[TurnPlan], session: aiohttp.ClientSession) -> None:
        crng = random.Random(seed * 1_000_003 + c)
        history = list(system)
        for t, tp in enumerate(turns):
            delay = tp.at_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            history += [crng.randrange(vocab) for _ in range(tp.user_tokens)]
            body = {"tokens": history, "max_new_tokens": tp.answer_tokens}
            got = await _post(session, url, body)
            res = TurnResult(
                c,
                t,
                got["prompt_tokens"],
                got["cached_tokens"],
                got["computed_tokens"],
                got["seconds"],
                got["tokens"],
            )
            if verify:
                ref = await _post(session, url, {**body, "use_cache": False})
                res.verified = ref["tokens"] == got["tokens"]
            results.append(res)
            history += got["tokens"]

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(conversation(c, p, session) for c, p in enumerate(plans)))
    return results


def summarize(results: list[TurnResult]) -> dict[str, Any]:
    """Totals: prompt tokens, tokens reused from kvtier, per-turn latency, verification."""
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    later = [r for r in results if r.turn > 0]
    return {
        "turns": len(results),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "reuse_fraction": cached / prompt if prompt else 0.0,
        "later_turns_with_hits": sum(1 for r in later if r.cached_tokens > 0),
        "later_turns": len(later),
        "mean_seconds": sum(r.seconds for r in results) / len(results) if results else 0.0,
        "verified": None
        if any(r.verified is None for r in results)
        else all(r.verified for r in results),
        "per_turn": [{k: v for k, v in asdict(r).items() if k != "answer"} for r in results],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--trace", type=Path, default=None, help="Azure LLM conversation trace CSV")
    ap.add_argument("--time-scale", type=float, default=0.05, help="trace seconds -> real")
    ap.add_argument("--token-scale", type=int, default=16, help="divide trace token counts")
    ap.add_argument("--max-user", type=int, default=48)
    ap.add_argument("--max-answer", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=256, help="the server model's vocabulary")
    ap.add_argument("--verify", action="store_true", help="compare with uncached answers")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    plans = plan(
        args.conversations,
        args.turns,
        args.trace,
        args.time_scale,
        args.token_scale,
        args.max_user,
        args.max_answer,
        args.seed,
    )
    results = asyncio.run(play(args.url, plans, args.vocab, verify=args.verify, seed=args.seed))
    print(json.dumps(summarize(results), indent=2))


if __name__ == "__main__":
    main()
