"""The benchmark's workload, modelled on the reference prefix-cache benchmark
(AIS-Bench): ``requests`` prompts of ``input_len`` tokens whose first
``repeat_rate * input_len`` tokens are one of ``prefixes`` shared prefixes,
the rest unique, ``output_len`` greedy tokens each, at most ``concurrency``
requests in flight (vLLM's ``max_num_seqs``).

Scenarios:

* ``default``: the shared prefixes were served before (the "fill" phase);
  the trace then repeats them - from vLLM's own cache in the engine that
  served them, from the pool in a fresh engine;
* ``working-set``: the same, with an HBM KV cache too small for the working
  set (vLLM's own cache evicts the prefixes; the pool keeps them);
* ``restart``: no fill; the instance restarts halfway through the trace (a
  new engine process serves the second half: vLLM's own cache starts empty,
  the pool does not).
"""

from __future__ import annotations

import dataclasses
from typing import Any

SCENARIOS = ("default", "working-set", "restart")


@dataclasses.dataclass(frozen=True)
class Workload:
    requests: int = 16
    input_len: int = 3200
    output_len: int = 4
    concurrency: int = 4
    repeat_rate: float = 0.9
    prefixes: int = 4
    seed: int = 0

    @property
    def prefix_len(self) -> int:
        return int(self.input_len * self.repeat_rate)

    def prefix(self, k: int) -> dict[str, Any]:
        return {"prefix": [self.prefix_len, 10_000 + 97 * self.seed + k]}

    def trace(self) -> list[dict[str, Any]]:
        """Prompt specs (``testing.engines``): prefix ``i % prefixes`` then a
        unique suffix."""
        return [dict(self.prefix(i % self.prefixes),
                     suffix=[self.input_len - self.prefix_len, 20_000 + 1000 * self.seed + i])
                for i in range(self.requests)]

    def fill(self) -> list[dict[str, Any]]:
        """One request per shared prefix (prefix + a short unique tail)."""
        return [dict(self.prefix(k), suffix=[16, 30_000 + k]) for k in range(self.prefixes)]

    def warmup(self) -> list[dict[str, Any]]:
        """What every engine serves first, unrelated to the trace: as many
        prompts as the fill, of the full input length, so that every
        configuration's engine is equally warm (its KV cache memory touched,
        its code paths run) - a fresh engine's first large prefill is slower."""
        return [{"prefix": [self.input_len, 90_000 + k]} for k in range(self.prefixes)]

    @property
    def prompt_tokens(self) -> int:
        return self.requests * self.input_len
