#!/usr/bin/env python
"""End-to-end GPU check of the KDA layer hooks (kda-layer-hooks) on a real
vLLM engine: a tiny Kimi-Linear model (3 KDA layers + 1 MLA layer, seeded
dummy weights), Model Runner V2, prefix caching, the overlay's
TracingConnector as the KV connector, in-process engine.

It asserts the same protocol as tests/test_hybrid_patches_e2e.py's
test_gdn_layer_hooks_protocol does for GDN on CPU:

* nothing reaches the connector's per-layer hooks before the first
  bind_connector_metadata (profile / warm-up / cudagraph-capture runs);
* in every step with connector metadata: exactly one wait then one save per
  hooked layer, layers in model order (KDA layers included, not only MLA);
* for each KDA layer: wait -> (deferred mamba copy) -> wait done -> compute-
  start fence -> save;
* the deferred mamba pre-copy ran once per KDA layer per deferring step, from
  inside that layer's wait (deferred-mamba-precopy on KDA state).

KDA has no CPU implementation, so this cannot run in the CPU test suite. Run
it on a CUDA machine with vLLM and this package installed:

    python tests/gpu/check_kda_hooks.py

Exit status: 0 all checks passed, 1 a check failed, 2 the engine could not be
set up (tiny config / environment problem, not a hook verdict).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import traceback
from pathlib import Path

KDA_LAYERS = (1, 2, 3)  # 1-based indices, as in Kimi-Linear's linear_attn_config
FULL_ATTN_LAYERS = (4,)


def tiny_kimi_linear_config() -> dict:
    """A Kimi-Linear config small enough to start in seconds: 3 KDA layers,
    one MLA layer (NoPE, kv_lora_rank 512 + rope 64 as the MLA kernels
    expect), dense MLPs, no MoE."""
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": 4096,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": len(KDA_LAYERS) + len(FULL_ATTN_LAYERS),
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "num_experts": None,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "kda_layers": list(KDA_LAYERS),
            "full_attn_layers": list(FULL_ATTN_LAYERS),
            "num_heads": 4,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
        },
    }


def write_model_dir(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(tiny_kimi_linear_config(), indent=2))
    return directory


def prompt(n: int, seed: int, vocab: int = 4096) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def layer_index(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name + ".")
    return int(m.group(1)) if m else -1


def split_steps(events: list[tuple[str, str, int]]) -> list[list[tuple[str, str]]]:
    """Events of each step that had connector metadata and a forward (cut
    after each wait_for_save; segments without a bind are profile / warm-up
    runs; a bind without any layer hook or pre-copy deferral is the empty
    batch vLLM's asynchronous scheduling - the GPU default - runs once the
    last request has finished)."""
    steps, current = [], []
    for kind, name, _ in events:
        current.append((kind, name))
        if kind == "wait_for_save":
            if any(k == "bind" for k, _ in current) and any(
                    k in ("load", "save", "prepare") for k, _ in current):
                steps.append(current)
            current = []
    return steps


class Checks:
    def __init__(self) -> None:
        self.results: list[tuple[str, bool, str]] = []

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.results.append((name, bool(ok), detail))
        return bool(ok)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(ok for _, ok, _ in self.results)

    def report(self) -> None:
        for name, ok, detail in self.results:
            print(f"  [{'PASS' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""))


def verify(events, status, outputs, kda_names, deferral: bool = True) -> Checks:
    """``deferral``: also check deferred-mamba-precopy (Model Runner V2 only)."""
    c = Checks()
    st = status.get("kda-layer-hooks", {})
    c.check("kda-layer-hooks applied", st.get("state") == "applied",
            f"{st.get('state')} {st.get('reason', '')}".strip())
    if deferral:
        dm = status.get("deferred-mamba-precopy", {})
        c.check("deferred-mamba-precopy applied", dm.get("state") == "applied",
                f"{dm.get('state')} {dm.get('reason', '')}".strip())
    c.check("generation produced tokens", all(o["tokens"] for o in outputs), json.dumps(outputs))

    kinds = [k for k, _, _ in events]
    if not c.check("connector metadata was bound", "bind" in kinds):
        return c
    first_bind = kinds.index("bind")
    early = [e for e in events[:first_bind] if e[0] in ("load", "save", "fence")]
    c.check("no hook before the first bind (profile / warm-up / capture)", not early,
            str(early[:6]))

    steps = split_steps(events)
    c.check("steps with connector metadata", len(steps) >= 2, f"{len(steps)} steps")
    bad_order, bad_seq, bad_copy, deferring = [], [], [], 0
    for i, evs in enumerate(steps):
        hooks = [(k, n) for k, n in evs if k in ("load", "save")]
        names = sorted({n for _, n in hooks}, key=layer_index)
        expected = [(k, n) for n in names for k in ("load", "save")]
        missing = [n for n in kda_names if n not in names]
        if hooks != expected or missing or not any(layer_index(n) == 3 for n in names):
            bad_order.append((i, hooks, missing))
        for layer in kda_names:
            seq = [k for k, n in evs if n == layer and k in ("load", "wait_done", "fence", "save")]
            if seq != ["load", "wait_done", "fence", "save"]:
                bad_seq.append((i, layer, seq))
        if any(k == "prepare" for k, _ in evs):
            deferring += 1
            for layer in kda_names:
                seq = [(k, n) for k, n in evs if n == layer or n.startswith(layer + ":")]
                want = [("load", layer), ("copy_call", f"{layer}:True"), ("wait_done", layer)]
                if [e for e in seq if e[0] in ("load", "copy_call", "wait_done")] != want:
                    bad_copy.append((i, layer, seq))
    c.check("one wait then one save per hooked layer per step, in layer order "
            "(all KDA layers and the MLA layer)", not bad_order, str(bad_order[:2]))
    c.check("KDA layer: wait -> wait done -> fence -> save", not bad_seq, str(bad_seq[:3]))
    if deferral:
        c.check("deferred pre-copy once per KDA layer, inside its wait",
                deferring > 0 and not bad_copy, f"{deferring} deferring steps; {bad_copy[:2]}")
    return c


def run_engine(model_dir: Path, args) -> tuple[list, dict, list]:
    import vllm_layerwise_patch
    from vllm_layerwise_patch.testing import tracing_connector as tc

    vllm_layerwise_patch.activate()  # before any vLLM model module is imported
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(model_dir),
        load_format="dummy",  # vLLM's seeded dummy init (seed 1234): deterministic
        skip_tokenizer_init=True,
        enforce_eager=not args.cudagraph,
        enable_prefix_caching=True,
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=4,
        max_num_batched_tokens=1024,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=0,
        kv_transfer_config={
            "kv_connector": "TracingConnector",
            "kv_connector_module_path": "vllm_layerwise_patch.testing.tracing_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"defer": True},
        },
    )
    tc.record("engine_ready")
    p1 = prompt(1400, seed=7)
    p2 = p1[:1300] + prompt(100, seed=8)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = []
    for p in (p1, p2):
        o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
        outputs.append({"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens})
    return list(tc.EVENTS), vllm_layerwise_patch.status(), outputs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="where to write the tiny config (default: a temp dir)")
    ap.add_argument("--runner", choices=("v2", "v1"), default="v2",
                    help="Model Runner V2 (default) or V1")
    ap.add_argument("--cudagraph", action="store_true",
                    help="do not force enforce_eager (hooks are skipped under FULL cudagraphs)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--json", type=Path, default=None, help="write events and results here")
    args = ap.parse_args(argv)

    os.environ.setdefault("VLLM_LAYERWISE_PATCH", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # events are read in-process
    # TP=1 never uses the GEMM-AR kernel; off, its cute_dsl import is skipped
    os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"

    kda_names = [f"model.layers.{i - 1}.self_attn" for i in KDA_LAYERS]
    with tempfile.TemporaryDirectory(prefix="tiny-kimi-linear-") as tmp:
        model_dir = write_model_dir(args.model_dir or Path(tmp) / "model")
        try:
            events, status, outputs = run_engine(model_dir, args)
        except Exception:
            traceback.print_exc()
            print("\nRESULT: SETUP ERROR - the tiny Kimi-Linear engine did not run "
                  "(see the traceback above; this is not a verdict on the hooks)")
            return 2
    checks = verify(events, status, outputs, kda_names, deferral=args.runner == "v2")
    print("\nKDA layer-hook check (tiny Kimi-Linear, runner "
          f"{args.runner}, prefix caching, TracingConnector):")
    checks.report()
    if args.json is not None:
        args.json.write_text(json.dumps({
            "passed": checks.passed, "results": checks.results, "status": status,
            "outputs": outputs, "events": events}, indent=1, default=str))
    print(f"\nRESULT: {'PASS' if checks.passed else 'FAIL'} "
          f"({sum(ok for _, ok, _ in checks.results)}/{len(checks.results)} checks)")
    return 0 if checks.passed else 1


if __name__ == "__main__":
    sys.exit(main())
