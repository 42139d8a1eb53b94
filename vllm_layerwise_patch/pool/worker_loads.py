"""The worker's loads: which keys fill which pages this step (each key read
once however many requests share it), the test knob that makes a layer's
load fail, and what a failed load does - the request goes back to vLLM's
load-failure policy, the broken block leaves the pool - and the pins a
finished load releases.  A mixin of :class:`.worker.PoolWorker`."""

from __future__ import annotations

import torch

from .keys import ATTN, STATE, draft_page_key, group_of, layer_id, page_key
from .metadata import LoadSpec, PoolMetadata, load_groups, owner_of
from .pipeline import LoadItem


class WorkerLoads:
    def _load_tasks(self, meta: PoolMetadata, bulk: bool) -> dict[str, list[LoadItem]]:
        """Per layer, the (key, destination pages) items of this step's loads,
        each key read once however many requests load it (requests sharing a
        prefix in one step); ``self._owners[layer][i]`` lists the requests
        item ``i`` serves."""
        tasks, self._owners = self._plan_loads(meta.loads, bulk)
        return tasks

    def _plan_loads(self, loads: list[LoadSpec], bulk: bool
                    ) -> tuple[dict[str, list[LoadItem]], dict[str, list[list[str]]]]:
        """Per layer, the items of ``loads`` and the requests each item serves."""
        tasks: dict[str, list[LoadItem]] = {}
        owners: dict[str, list[list[str]]] = {}
        rank = self.tp_rank
        if self.faults.load_tp_rank >= 0:  # negative control (tests)
            rank = self.faults.load_tp_rank
        for layer in self.order:
            g, kind = self.layer_group[layer], self.layer_kind[layer]
            idx, draft = layer_id(layer), layer in self.layout.drafter_layers
            merged: dict[bytes, tuple[list[torch.Tensor], list[str]]] = {}

            def add(key: bytes, dests: list[torch.Tensor], req: str) -> None:
                d, reqs = merged.setdefault(key, ([], []))
                d += dests
                if req not in reqs:
                    reqs.append(req)

            for spec in loads:
                if kind == ATTN:
                    for i, (h, bid) in enumerate(zip(spec.hashes, spec.attn_blocks.get(g, []))):
                        key = (draft_page_key(self.ns, h, rank, idx, spec.next_tokens[i])
                               if draft else page_key(self.ns, ATTN, h, rank, idx))
                        add(key, [self.page(layer, bid)], spec.req_id)
                elif g in spec.mamba_blocks and not self.faults.skip_mamba_load:
                    dests = [self.page(layer, spec.mamba_blocks[g])]
                    running = spec.running_blocks.get(g)
                    if bulk and running is not None and running != spec.mamba_blocks[g]:
                        dests.append(self.page(layer, running))
                    add(page_key(self.ns, STATE, spec.hashes[-1], rank, idx), dests,
                        spec.req_id)
            tasks[layer] = [(k, d) for k, (d, _) in merged.items()]
            owners[layer] = [o for _, o in merged.values()]
        return tasks, owners

    @staticmethod
    def _tolerate(meta: PoolMetadata) -> bool:
        """Report failed loads to vLLM (the request recomputes) only when the
        scheduler process can take block load errors for this layout (the
        ``hybrid-load-recompute`` patch, announced in the metadata);
        otherwise a failed load raises: the forward must not run on a wrong
        state."""
        return bool(getattr(meta, "report_load_errors", False))

    def _debug_fail(self, tasks: dict[str, list[LoadItem]]) -> dict[str, list[LoadItem]]:
        """debug_fail_load_layer (tests): that layer's loads fail in the first
        step that loads it, as a pool entry removed between lookup and load
        would."""
        layer = self.faults.fail_load_layer
        if layer and layer in tasks and not self._debug_failed:
            self._debug_failed = True
            tasks[layer] = [(b"\0debug-missing/" + k, d) for k, d in tasks[layer]]
        return tasks

    def _collect_failures(self) -> set[str]:
        """Requests whose loads failed this step (tolerant mode); the blocks
        behind a failed item are dropped from the pool (so they are saved
        again when recomputed)."""
        if self.pipeline is None or not self.pipeline.failures:
            return self._failed_reqs
        broken = set()
        for layer, i, key, exc in self.pipeline.failures:
            if not key.startswith(b"\0"):  # (a debug_fail_load_layer key)
                broken.add(group_of(key))
            for req in self._owners.get(layer, [])[i]:
                if req in self._failed_reqs:
                    continue
                self._failed_reqs.add(req)
                self.stats.add(load_failures=1)
                self.log.warning(
                    "load", "vllm-layerwise-patch pool: a load failed (%s: %s); request %s "
                    "is handed back to vLLM's kv_load_failure_policy (recompute or fail) "
                    "and its pages are not used (further failures are counted in the "
                    "metrics, not logged)", type(exc).__name__, exc, req)
        self.pipeline.failures = []
        self._drop_broken(broken)
        return self._failed_reqs

    def _drop_broken(self, groups: set[bytes]) -> None:
        """Remove the blocks behind failed loads from the pool (they are saved
        again when recomputed)."""
        if groups:
            try:
                self.backend.delete_groups(sorted(groups))
            except Exception:  # noqa: BLE001 - best effort; the lookup drops them too
                pass

    def _release_pins(self, loads: list[LoadSpec]) -> None:
        """This rank has read what ``loads`` needed: release the scheduler's
        pins on this rank's groups."""
        for spec in loads:
            groups = load_groups(self.ns, spec.hashes, [self.tp_rank], self.layout.has_state)
            try:
                self.backend.unpin(groups, owner_of(spec.req_id))
            except Exception:  # noqa: BLE001 - pins expire after pin_seconds anyway
                pass

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Every block id (all groups) of this step's loads that failed: the
        patched scheduler maps them back to the requests holding them."""
        failed = self._collect_failures()
        if not failed or self._meta is None or self.faults.hide_load_errors:
            return set()
        out: set[int] = set()
        for spec in self._meta.loads:
            if spec.req_id in failed:
                for ids in spec.attn_blocks.values():
                    out.update(ids)
                out.update(spec.mamba_blocks.values())
        return out
