"""A Mooncake-format request trace (FAST'25 release, ``traces/*.jsonl``; what
SGLang's ``bench_serving`` replays as its ``mooncake`` dataset): one JSON
object per line with ``timestamp`` (ms from the trace's start),
``input_length`` and ``output_length`` (tokens) and ``hash_ids``: the ids of
the prompt's 512-token blocks, a block id standing for one block's content
*and everything before it* - requests that share their first hash ids share
that prefix.

Here a trace becomes token-id prompts for a model of any vocabulary: block id
``h`` becomes a fixed pseudo-random block of ``block_tokens`` ordinary token
ids (a function of ``h`` alone), the prompt is its blocks in order, cut to
``input_length`` - so equal hash-id prefixes give equal token prefixes and
different ids give different blocks. ``scale`` divides the lengths and the
512-token block (a CPU-sized replay keeps the trace's block structure).

A *session* is the requests sharing their first ``session_blocks`` hash ids
(in the conversation trace every request starts with block 0, a shared system
prompt, and a conversation's turns share the next ones); ``--sessions N``
keeps N whole sessions, so the reuse inside them survives the subsampling.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterable
from typing import Any

TRACE_BLOCK_TOKENS = 512


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int = 0  # 1-based line in the trace file


class TraceError(ValueError):
    """A trace line that is not a Mooncake-format request (names line and field)."""


def _field(obj: dict[str, Any], name: str, line: int, kind: type) -> Any:
    if name not in obj:
        raise TraceError(f"trace line {line}: missing field {name!r}")
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, kind) or v < 0:
        raise TraceError(f"trace line {line}: field {name!r} must be a non-negative "
                         f"{'number' if kind is not int else 'integer'}, got {v!r}")
    return v


def parse(lines: Iterable[str]) -> list[TraceRequest]:
    """The requests of a trace's lines (blank lines skipped), in file order."""
    out = []
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"trace line {n}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"trace line {n}: not a JSON object")
        ts = _field(obj, "timestamp", n, (int, float))
        inp = _field(obj, "input_length", n, int)
        outp = _field(obj, "output_length", n, int)
        ids = obj.get("hash_ids")
        if not isinstance(ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in ids):
            raise TraceError(f"trace line {n}: field 'hash_ids' must be a list of integers")
        if len(ids) * TRACE_BLOCK_TOKENS < inp:
            raise TraceError(f"trace line {n}: field 'hash_ids' has {len(ids)} blocks of "
                             f"{TRACE_BLOCK_TOKENS} tokens, fewer than input_length {inp}")
        out.append(TraceRequest(float(ts), inp, outp, tuple(ids), n))
    return out


def load(path: str) -> list[TraceRequest]:
    with open(path) as f:
        return parse(f)


def sessions(reqs: list[TraceRequest], session_blocks: int = 2
             ) -> list[list[TraceRequest]]:
    """Requests grouped by their first ``session_blocks`` hash ids, in order
    of each session's first request."""
    groups: dict[tuple[int, ...], list[TraceRequest]] = {}
    for r in reqs:
        groups.setdefault(r.hash_ids[:session_blocks], []).append(r)
    return list(groups.values())


def select(reqs: list[TraceRequest], *, sessions_n: int | None = None,
           session_blocks: int = 2, min_session_requests: int = 2,
           max_input_length: int | None = None) -> list[TraceRequest]:
    """Keep whole sessions: the first ``sessions_n`` (by first arrival) with at
    least ``min_session_requests`` requests, none longer than
    ``max_input_length``; the kept requests in timestamp order (file order
    among equal timestamps). ``sessions_n=None``: every request that passes
    the length filter."""
    if sessions_n is None:
        kept = [r for r in reqs if max_input_length is None or r.input_length
                <= max_input_length]
    else:
        groups = [g for g in sessions(reqs, session_blocks)
                  if len(g) >= min_session_requests and (
                      max_input_length is None
                      or max(r.input_length for r in g) <= max_input_length)]
        kept = [r for g in groups[:sessions_n] for r in g]
    return sorted(kept, key=lambda r: (r.timestamp_ms, r.line))


def block_tokens(scale: int) -> int:
    if scale < 1 or TRACE_BLOCK_TOKENS % scale:
        raise ValueError(f"--scale must divide {TRACE_BLOCK_TOKENS}, got {scale}")
    return TRACE_BLOCK_TOKENS // scale


def _block(h: int, n: int, vocab: tuple[int, int], salt: int) -> list[int]:
    rng = random.Random(f"trace-block:{salt}:{h}")
    return [rng.randrange(*vocab) for _ in range(n)]


def prompt(r: TraceRequest, scale: int = 1, *, vocab: tuple[int, int] = (3, 1024),
           salt: int = 0) -> list[int]:
    """The token ids of ``r``'s prompt at ``scale``: its blocks' tokens in order,
    cut to ``input_length / scale`` (at least one token). ``vocab``: the
    ordinary token ids' range [lo, hi)."""
    n = block_tokens(scale)
    length = max(1, r.input_length // scale)
    blocks = -(-length // n)
    ids: list[int] = []
    for h in r.hash_ids[:blocks]:
        ids += _block(h, n, vocab, salt)
    return ids[:length]


def output_length(r: TraceRequest, scale: int = 1, cap: int | None = None) -> int:
    n = max(1, r.output_length // scale)
    return min(n, cap) if cap else n


def stats(reqs: list[TraceRequest], scale: int = 1) -> dict[str, Any]:
    """What a selection holds: requests, sessions, prompt tokens (scaled),
    distinct blocks (the working set), the blocks used that an earlier request
    used too (``block_reuse``) and ``prefix_hit_bound``: the prompt tokens an
    unbounded prefix cache of the trace's blocks would hit (each request's
    longest prefix of blocks seen before, its last token always computed)."""
    seen: set[int] = set()
    hits = total = prefix_hits = 0
    n = block_tokens(scale)
    for r in reqs:
        length = max(1, r.input_length // scale)
        used = r.hash_ids[:-(-length // n)]
        total += len(used)
        hits += sum(h in seen for h in used)
        k = 0
        while k < len(used) and used[k] in seen:
            k += 1
        prefix_hits += min(k * n, length - 1)
        seen.update(used)
    tokens = sum(max(1, r.input_length // scale) for r in reqs)
    return {"requests": len(reqs), "sessions": len(sessions(reqs)),
            "prompt_tokens": tokens,
            "distinct_blocks": len(seen), "working_set_tokens": len(seen) * n,
            "block_reuse": hits / total if total else 0.0,
            "prefix_hit_bound": prefix_hits / tokens if tokens else 0.0,
            "span_s": (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1e3 if reqs else 0.0}
