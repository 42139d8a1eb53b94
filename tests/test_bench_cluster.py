"""``bench --trace --cluster`` (bench/cluster.py): requests alternate
between the engines' servers, the tiered verdict reads the right runs and
figures, the summary shows them, bad backends and sizes are refused.  (The
servers here are stdlib stand-ins streaming vLLM's completion chunks: the
routing is what is tested; the real two-engine replay is the benchmark.)"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

TRACE = '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [0, 1]}'


def _server(name: str, seen: list):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((name, body["prompt"][0]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chunk = {"choices": [{"text": "x", "token_ids": [body["prompt"][0]]}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.mark.parametrize("timestamps", [None, [0.0, 0.01, 0.02, 0.03, 0.04]],
                         ids=["closed-loop", "open-loop"])
def test_requests_alternate_between_the_engines(timestamps):
    from vllm_layerwise_patch.bench.replay import replay

    seen: list = []
    a, b = _server("a", seen), _server("b", seen)
    try:
        urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in (a, b)]
        out = replay(urls, "m", [[i] for i in range(5)], [1] * 5, concurrency=2,
                     timestamps_s=timestamps)
    finally:
        a.shutdown()
        b.shutdown()
    assert [o["tokens"] for o in out] == [[i] for i in range(5)]
    assert sorted(seen) == [("a", 0), ("a", 2), ("a", 4), ("b", 1), ("b", 3)]


def _run(backend, p50, pool, near=None, evictions=0.0, used=None):
    r = {"engines": 2, "backend": backend, "ttft_s": {"p50": p50, "p90": 2 * p50},
         "hit_rate": {"hbm": 0.3, "pool": pool}, "seconds": 10.0,
         "pool": {"evictions": evictions, "promoted_blocks": 7.0 if near else 0.0},
         "capacity_bytes": 256 << 20, "pool_used_bytes": used}
    if near is not None:
        r.update(near_share=near, near_share_of_loads=0.9, near_capacity_bytes=48 << 20)
    return r


def test_the_tiered_verdict_and_its_summary():
    from vllm_layerwise_patch.bench.cluster import markdown, verdict

    results = {"hbm": {"ttft_s": {"p50": 1.0}},
               "2x lmdb@256MiB": _run("lmdb", 1.0, 0.3, used=160 << 20),
               "2x mooncake@256MiB": _run("mooncake", 2.0, 0.3),
               "2x tiered@48MiB/256MiB": _run("tiered", 1.5, 0.3, near=0.625)}
    results["2x tiered@96MiB/256MiB"] = _run("tiered", 1.0, 0.3, near=0.9)
    results["2x tiered@96MiB/256MiB"]["near_capacity_bytes"] = 96 << 20
    v, v96 = verdict(results)
    assert v96["config"] == "2x tiered@96MiB/256MiB" and v96["near_share"] == 0.9
    assert v96["ttft_p50_ratio_tiered_to_mooncake"] == 0.5
    assert v["near_share"] == 0.625
    assert v["ttft_p50_ratio_tiered_to_mooncake"] == 0.75
    assert v["near_fraction_of_working_set"] == pytest.approx(48 / 160)
    results["2x lmdb@1GiB"] = {"engines": 2, "error": "RuntimeError: boom"}
    text = "\n".join(markdown({"results": results, "cluster": [v, v96]}))
    (row,) = [x for x in text.splitlines() if x.startswith("| 2x lmdb@1GiB |")]
    header = [x for x in text.splitlines() if x.startswith("| config |")][0]
    assert "error: RuntimeError: boom" in row and row.count("|") == header.count("|")
    assert "| 2x tiered@48MiB/256MiB | 30.0% | 30.0% | 62.5% | 90.0% |" in text
    assert "| 2x mooncake@256MiB | 30.0% | 30.0% | - | - |" in text
    assert "found **62.5%** of the pool's hit tokens in the near tier" in text
    assert "= 30% of the saved working set" in text and "**0.75**" in text
    assert "`2x tiered@96MiB/256MiB` against Mooncake alone: the lookups found **90.0%**" in text
    # an lmdb run that evicted does not stand for the working set
    results["2x lmdb@256MiB"]["pool"]["evictions"] = 3.0
    assert verdict(results)[0]["near_fraction_of_working_set"] is None
    # without the Mooncake run there is nothing to compare
    del results["2x mooncake@256MiB"]
    assert verdict(results) is None


@pytest.mark.parametrize("args,msg", [
    (["--cluster", "lmdb,redis"], "unknown backend 'redis'"),
    (["--cluster", "tiered", "--near-capacity", "48 potatoes"], "cannot read size"),
    (["--cluster", "tiered", "--near-capacity", "48MiB:tepid"],
     "near_saves 'tepid' is not one of hot, cold, off"),
])
def test_bad_cluster_arguments_are_refused(tmp_path, args, msg):
    from vllm_layerwise_patch.bench import main

    trace = tmp_path / "t.jsonl"
    trace.write_text(TRACE + "\n" + TRACE.replace('"timestamp": 0', '"timestamp": 5') + "\n")
    with pytest.raises(SystemExit, match=msg):
        main(["--trace", str(trace), "--model", "x", "--out", str(tmp_path / "o"), *args])


def test_session_routing_keeps_a_sessions_requests_on_one_engine():
    from pathlib import Path

    from vllm_layerwise_patch.bench import trace as tr
    from vllm_layerwise_patch.bench.cluster import routes
    from vllm_layerwise_patch.bench.replay import ReplaySetup

    line = '{{"timestamp": {t}, "input_length": 600, "output_length": 1, "hash_ids": {ids}}}'
    reqs = tr.parse([line.format(t=t, ids=ids) for t, ids in enumerate(
        ([0, 1], [0, 2], [0, 1, 5], [0, 3], [0, 2, 6], [0, 1, 7]))])
    s = ReplaySetup(model="m", work=Path("."), requests=reqs)
    assert routes(s, "alternate") == [0, 1, 0, 1, 0, 1]
    # sessions [0,1] -> engine 0, [0,2] -> 1, [0,3] -> 0 (in order of first arrival)
    assert routes(s, "session") == [0, 1, 0, 0, 1, 0]


def test_a_near_tier_policy_names_its_configuration_and_sets_the_field(tmp_path):
    from pathlib import Path

    from vllm_layerwise_patch.bench.cluster import _pool, names
    from vllm_layerwise_patch.bench.replay import ReplaySetup
    from vllm_layerwise_patch.pool.config import PoolConfig

    got = names(["tiered"], "256MiB", "48MiB,48MiB:cold")
    assert [n for n, _, _ in got] == ["2x tiered@48MiB/256MiB",
                                      "2x tiered@48MiB/256MiB near_saves=cold"]
    s = ReplaySetup(model="m", work=Path(tmp_path), requests=[])
    for (_, backend, near), want in zip(got, ("hot", "cold")):
        extra = _pool(s, backend, 0, "256MiB", near, "127.0.0.1:1")
        cfg = PoolConfig.from_extra(extra)
        assert cfg.capacity == 48 << 20 and cfg.tiered.near_saves == want
