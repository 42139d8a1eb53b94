"""Which blocks a step stores (engine-core process): the blocks each
scheduled request completes in this step, beyond what its hit loaded,
minus those the pool already holds - attention pages per block (and the
drafter's pages keyed by the token after the block, when known), the
boundary state when the step ends on a block boundary.
:class:`.planner.PoolScheduler` calls :func:`plan_saves` once per step."""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from ..identity.adapters import adapter_of
from ..keys import ATTN, STATE
from ..metadata import AttnSave, SaveSpec


def _ids(layout: Any, t: Any, col: int, kind: str) -> dict[int, int]:
    """Block id of column ``col`` in each group of ``kind`` (as the worker's
    block table holds them)."""
    return {g: t.blocks[g][col] for g in layout.groups(kind) if col < len(t.blocks[g])}


def plan_saves(steps: list[tuple[str, int, int]], tracked: dict[str, Any], layout: Any,
               hits: Any, skip: Container[str] = ()) -> list[SaveSpec]:
    """The saves of a step: ``steps`` are (request id, tokens computed
    before, tokens scheduled); ``tracked`` the planner's requests (their
    blocks and hit), ``hits`` its lookup (what the pool holds); requests in
    ``skip`` store nothing (retired by a weights change)."""
    B, L = layout.block_size, layout
    saves = []
    for req_id, before, n in steps:
        if n <= 0 or req_id in skip:
            continue
        t = tracked[req_id]
        hashes = t.request.block_hashes
        nblocks = L.num_blocks(hashes)
        after = before + n
        first = max(before // B, t.loaded_end)
        done = [j for j in range(first, after // B) if j < nblocks]
        attn, mamba = [], []
        if done:
            names = [L.block_hash(hashes, j) for j in done]
            tokens = [hits.next_token(t.request, j) if hits.drafter else None for j in done]
            known = [(h, tok) for h, tok in zip(names, tokens) if tok is not None]
            found = iter(hits.draft_present(known) if known else [])
            drafts = [tok is None or next(found) for tok in tokens]
            for j, h, tok, present, draft in zip(done, names, tokens,
                                                 hits.present(ATTN, names), drafts):
                if not present or (tok is not None and not draft):
                    attn.append(AttnSave(h, _ids(L, t, j, ATTN), tok, draft_only=present))
        if after % B == 0 and L.has_state:
            j = after // B - 1
            ids = _ids(L, t, j, STATE) if j < nblocks else {}
            # block 0 is vLLM's null block: no state lives there
            if j >= t.loaded_end and ids and 0 not in ids.values():
                h = L.block_hash(hashes, j)
                if not hits.present(STATE, [h])[0]:
                    mamba.append((h, ids))
        if attn or mamba:
            reads = sorted({b for ids in t.blocks for b in ids} - {0})
            saves.append(SaveSpec(req_id, attn, mamba, reads, adapter_of(t.request)))
    return saves
