"""Which blocks each step saves (scheduler side): a request's attention pages
of every block whose prefix hash is known and whose tokens are computed by
the end of the step, once each, and the linear-attention state of a block
boundary in the step that computes it.

The hash of a block comes with its last token id.  In a prefill every token
id is known when the step is planned; in a decode, with vLLM's asynchronous
scheduling (the GPU default) the last token of a block is sampled by the
step before and appended only after the next step was planned: the step
that completes a block in a decode does not know its hash yet, the one after
it does.  So the attention pages of a block are saved by the first step that
knows its hash (the pages stay in the request's block table, unchanged),
and the state at a block boundary that a decode reaches, by that very next
step: vLLM's "align" mode keeps that boundary's state in the block's own
column until two steps after the next one (``MambaManager``: it frees the
column of the block allocated two steps before), and later steps only read
it.  A boundary whose hash is still unknown one step later (a request
preempted or finished meanwhile) is not saved.  Before this, blocks a decode
completed under asynchronous scheduling were never saved: the next turn of a
chat did not hit into the reply.

Speculative decoding (a drafter layout) keeps the rule of the step itself:
its scheduled tokens may be rejected, so a block "completed" by a plan is
not known to be, and the token after a block (the drafter pages' key) comes
later still.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container
from typing import Any

from ..identity.adapters import adapter_of
from ..keys import ATTN, STATE
from ..metadata import AttnSave, SaveSpec


@dataclasses.dataclass
class Tracked:
    """What the scheduler side knows of a request it looked up."""
    request: Any
    blocks: list[list[int]]  # per group, as the worker's block table holds them
    loaded_end: int = 0  # blocks [0, loaded_end) came from the pool
    # attention pages of blocks [.., saved_to) planned (None: from the next step on)
    saved_to: int | None = None
    # (column, step): a boundary state a step computed without knowing its hash
    state_due: tuple[int, int] | None = None

    def looked_up(self) -> None:
        """Looked up (again, after a preemption: it recomputes from its hit)."""
        self.loaded_end, self.saved_to, self.state_due = 0, None, None


class SavePlanner:
    def __init__(self, layout: Any, hits: Any, faults: Any) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.hits = hits  # the lookup: block names, presence, drafter tokens
        # the planning before the fix (tests): only blocks the step completes
        self.step_blocks_only = faults.save_step_blocks_only

    def _ids(self, t: Tracked, col: int, kind: str) -> dict[int, int]:
        return {g: t.blocks[g][col] for g in self.layout.groups(kind)
                if col < len(t.blocks[g])}

    def plan(self, steps: list[tuple[str, int, int]], tracked: dict[str, Tracked],
             step: int, skip: Container[str] = ()) -> list[SaveSpec]:
        """(req_id, tokens computed before the step, scheduled) of each
        request in scheduling step ``step`` -> the step's saves; requests in
        ``skip`` store nothing (retired by a weights change: .weight_changes)."""
        B, L = self.block_size, self.layout
        late = not (self.step_blocks_only or self.hits.drafter)
        saves = []
        for req_id, before, n in steps:
            if n <= 0 or req_id in skip:
                continue
            t = tracked[req_id]
            hashes = t.request.block_hashes
            nblocks = L.num_blocks(hashes)
            after = before + n
            first = before // B
            if late and t.saved_to is not None:
                first = min(first, t.saved_to)
            first = max(first, t.loaded_end)
            done = [j for j in range(first, after // B) if j < nblocks]
            t.saved_to = first + len(done)
            attn = self._attn(t, done)
            mamba = []
            due = [after // B - 1] if after % B == 0 and L.has_state else []
            if late and t.state_due is not None and t.state_due[1] == step - 1:
                due.append(t.state_due[0])  # a decode reached it in the step before
            t.state_due = None
            for j in due:
                ids = self._ids(t, j, STATE)
                # block 0 is vLLM's null block: no state lives there
                if j < t.loaded_end or not ids or 0 in ids.values():
                    continue
                if j >= nblocks:  # (its hash comes with the next step's plan)
                    t.state_due = (j, step) if late else None
                    continue
                h = L.block_hash(hashes, j)
                if not self.hits.present(STATE, [h])[0]:
                    mamba.append((h, ids))
            if attn or mamba:
                reads = sorted({b for ids in t.blocks for b in ids} - {0})
                saves.append(SaveSpec(req_id, attn, mamba, reads, adapter_of(t.request)))
        return saves

    def _attn(self, t: Tracked, done: list[int]) -> list[AttnSave]:
        """The attention saves of blocks ``done``: those not in the pool yet,
        and drafter pages of those whose next token is known and missing."""
        if not done:
            return []
        L = self.layout
        hashes = t.request.block_hashes
        names = [L.block_hash(hashes, j) for j in done]
        tokens = [self.hits.next_token(t.request, j) if self.hits.drafter else None
                  for j in done]
        known = [(h, tok) for h, tok in zip(names, tokens) if tok is not None]
        found = iter(self.hits.draft_present(known) if known else [])
        drafts = [tok is None or next(found) for tok in tokens]
        out = []
        for j, h, tok, present, draft in zip(done, names, tokens,
                                             self.hits.present(ATTN, names), drafts):
            if not present or (tok is not None and not draft):
                out.append(AttnSave(h, self._ids(t, j, ATTN), tok, draft_only=present))
        return out
