"""The bench command's arithmetic and arguments (no engines: the numbers it
reports come from real runs, committed under benchmarks/results/bench/)."""

from __future__ import annotations

import pytest

from vllm_layerwise_patch.bench.report import breakdown, markdown, ratios
from vllm_layerwise_patch.bench.workload import Workload


def _r(avg, p50=None, wait=0.0, requests=4):
    return {"requests": requests, "prompt_tokens": 400,
            "ttft_s": {"avg": avg, "p50": p50 or avg, "p90": avg, "p99": avg},
            "hit_rate": {"hbm": 0.0, "external": 0.5}, "input_tokens_per_s": 100.0,
            "load": {"GB": 1.0, "seconds": 2.0, "GB_per_s": 0.5, "exposed_wait_fraction": 0.1},
            "forward_wait_s": wait, "save": {"GB": 1.0, "seconds": 4.0},
            "same_tokens_as_hbm": 4}


RESULTS = {
    "default": {"hbm": _r(3.0, p50=1.0), "pool-layerwise": _r(1.6, wait=0.4),  # one slow HBM request
                "pool-layerwise-nosave": _r(1.3), "pool-bulk": _r(2.0),
                "no-prefix-cache": _r(3.2)},
    "default+torch-kernels": {"hbm": _r(0.9), "pool-layerwise": _r(1.1)},
}


def test_ratios_divide_the_right_configurations():
    r = ratios(RESULTS)["default"]
    assert r["layerwise_vs_hbm"] == 1.6
    assert r["layerwise_vs_no_prefix_cache"] == 0.5
    assert r["layerwise_vs_bulk"] == 0.8
    assert r["layerwise_vs_bulk_with_latency"] is None  # not run


def test_breakdown_parts_add_up_to_the_gap():
    b = breakdown(RESULTS)["default"]
    assert b["gap"] == pytest.approx(0.6)
    assert b["saves"] == pytest.approx(0.3)  # layerwise minus its kv_consumer twin
    assert b["exposed_load_wait"] == pytest.approx(0.1)  # 0.4 s over 4 requests
    assert b["interpreted_kernels"] == pytest.approx(0.6 - 0.2)  # gap minus torch's gap
    assert b["rest"] == pytest.approx(0.6 - 0.3 - 0.1 - 0.4)
    # a scenario without the torch twin has no pre-copy part
    assert breakdown(RESULTS)["default+torch-kernels"]["interpreted_kernels"] is None
    assert "save_send_cpu" not in b  # runs without the send thread's counters


def test_breakdown_splits_the_saves_per_request_outside_the_sum():
    results = {"d": {k: dict(v) for k, v in RESULTS["default"].items()}}
    lw = results["d"]["pool-layerwise"] = dict(results["d"]["pool-layerwise"])
    lw["save"] = {"GB": 1.0, "seconds": 4.0, "write_seconds": 1.0,
                  "send_thread_cpu_s": 0.8, "forward_hooks_s": 0.2}
    lw["layer_precopy_s"] = 0.4
    b = breakdown(results)["d"]
    assert b["layer_precopy"] == pytest.approx(0.1)
    assert b["save_send_cpu"] == pytest.approx(0.2)  # 0.8 s over 4 requests
    assert b["save_in_forward"] == pytest.approx(0.05)
    assert b["rest"] == pytest.approx(0.6 - 0.3 - 0.1)  # no torch twin; split not summed


def test_summary_names_every_configuration_and_reports_errors():
    doc = {"workload": Workload().__dict__, "model": {"description": "m", "note": ""},
           "machine": "x", "results": {**RESULTS, "restart": {"hbm": {"error": "boom"}}},
           "ratios": ratios(RESULTS), "breakdown": breakdown(RESULTS), "notes": []}
    doc["ratios"]["restart"] = {}
    text = markdown(doc)
    for name in ("pool-layerwise-nosave", "pool-bulk", "no-prefix-cache"):
        assert f"| {name} |" in text
    assert "error: boom" in text
    assert "layerwise vs hbm 1.600" in text


def test_workload_trace_repeats_prefixes_with_unique_suffixes():
    w = Workload(requests=6, input_len=100, repeat_rate=0.9, prefixes=2)
    t = w.trace()
    assert [p["prefix"] for p in t[:2]] != [t[0]["prefix"]] * 2
    assert t[0]["prefix"] == t[2]["prefix"] == t[4]["prefix"]
    assert len({tuple(p["suffix"]) for p in t}) == 6
    assert all(p["prefix"][0] + p["suffix"][0] == 100 for p in t)


def test_unknown_configuration_and_scenario_are_refused():
    from vllm_layerwise_patch.bench import main
    from vllm_layerwise_patch.bench.runs import configs

    with pytest.raises(SystemExit, match="unknown config"):
        configs(0.0, ["pool-layerwise", "pool-fast"])
    assert [c.name for c in configs(5.0, ["pool-bulk+latency"])] == ["pool-bulk+latency"]
    with pytest.raises(SystemExit, match="unknown scenario"):
        main(["--scenarios", "default,nope"])


def test_server_client_uses_the_prefix_repetition_dataset(tmp_path):
    from vllm_layerwise_patch.bench.server import client_args

    w = Workload(requests=8, input_len=1000, repeat_rate=0.9, prefixes=2, output_len=3)
    a = client_args("http://127.0.0.1:1", "/m", w, tmp_path / "r.json")

    def arg(flag):
        return a[a.index(flag) + 1]

    assert arg("--dataset-name") == "prefix_repetition"
    assert (arg("--prefix-repetition-prefix-len"), arg("--prefix-repetition-suffix-len")) == (
        "900", "100")
    assert arg("--num-prompts") == "8" and arg("--max-concurrency") == "4"
    assert arg("--result-filename") == "r.json"


def test_gpu_pipeline_benchmark_runs_on_cpu_and_checks_its_copies(tmp_path):
    """The torch-only pipeline benchmark (meant for a CUDA device) also runs
    on CPU, where its streams are threads: every path copies every byte (the
    script asserts it) and the JSON carries the numbers the README quotes."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu_pipeline.py"
    out = tmp_path / "gpu-pipeline.json"
    subprocess.run([sys.executable, str(script), "--device", "cpu", "--layers", "3",
                    "--pages", "2", "--page-mib", "0.25", "--compute-ms", "1",
                    "--repeats", "1", "--out", str(out)], check=True, timeout=300,
                   capture_output=True)
    (res,) = json.loads(out.read_text())["results"]
    assert res["device"] == "cpu" and res["layers"] == 3
    assert set(res["exposed_transfer_seconds"]) == {"bulk", "layerwise"}
    assert all(v >= 0 for v in res["exposed_transfer_seconds"].values())
    assert res["GB_per_s"]["load"] > 0 and res["GB_per_s"]["save"] > 0


def test_backend_benchmark_loads_every_byte_and_saves_ratios(tmp_path):
    """bench_backends on LMDB, a Mooncake client holding a segment (a real
    loopback master and holder) and the plain-socket ceiling: every load is
    checked byte for byte by the script, the JSON has a ratio per phase."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_backends.py"
    out = tmp_path / "backends.json"
    subprocess.run([sys.executable, str(script), "--backends", "lmdb,mooncake-own,tcp-socket",
                    "--mib-per-pass", "4", "--repeats", "1", "--out", str(out)],
                   check=True, timeout=300, capture_output=True)
    rows = json.loads(out.read_text())["results"]
    assert sorted({(r["backend"], r["page_bytes"]) for r in rows}) == sorted(
        (b, p) for b in ("lmdb", "mooncake-own", "tcp-socket") for p in (160 << 10, 2 << 20))
    phases = {r["backend"]: set(r["ratio_to_memcpy"]) for r in rows}
    assert phases == {"lmdb": {"save", "load_first", "load"}, "tcp-socket": {"load"},
                      "mooncake-own": {"save", "load_first", "load", "fetch"}}
    assert all(v > 0 for r in rows for v in r["ratio_to_memcpy"].values())


# --- bench --trace: a Mooncake-format trace (no server in these tests) -------

def _line(ts, inp, ids, out=8):
    import json

    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out,
                       "hash_ids": ids})


TRACE = [_line(0, 1200, [0, 1, 2]), _line(0, 900, [0, 7, 8]),  # sessions (0,1), (0,7)
         _line(5, 1800, [0, 1, 2, 3]), _line(6, 300, [0, 9]),  # (0,9): one request
         _line(9, 2400, [0, 1, 2, 3, 4]), _line(12, 1000, [0, 7, 8])]


def test_trace_parsing_names_the_line_and_field():
    from vllm_layerwise_patch.bench import trace as tr

    reqs = tr.parse(TRACE + [""])
    assert [r.line for r in reqs] == [1, 2, 3, 4, 5, 6]
    assert reqs[2].hash_ids == (0, 1, 2, 3) and reqs[2].input_length == 1800
    bad = {"not JSON": "{", "missing field 'output_length'":
           '{"timestamp": 0, "input_length": 5, "hash_ids": [1]}',
           "field 'input_length' must be a non-negative integer":
           _line(0, -1, [1]), "field 'hash_ids' must be a list": _line(0, 5, "12"),
           "field .hash_ids. has 2 blocks of 512 tokens, fewer than input_length 1025":
           _line(0, 1025, [1, 2])}
    for msg, line in bad.items():
        with pytest.raises(tr.TraceError, match=f"trace line 2: {msg}"):
            tr.parse([TRACE[0], line])


def test_trace_selection_keeps_whole_sessions_in_time_order():
    from vllm_layerwise_patch.bench import trace as tr

    reqs = tr.parse(TRACE)
    assert [len(g) for g in tr.sessions(reqs)] == [3, 2, 1]
    one = tr.select(reqs, sessions_n=1)
    assert [r.line for r in one] == [1, 3, 5]  # the whole first session
    two = tr.select(reqs, sessions_n=5)  # the one-request session is not a session
    assert [r.line for r in two] == [1, 2, 3, 5, 6]
    assert [r.line for r in tr.select(reqs, sessions_n=5, min_session_requests=1)] == [
        1, 2, 3, 4, 5, 6]
    short = tr.select(reqs, sessions_n=5, max_input_length=1800)  # drops (0,1) whole
    assert [r.line for r in short] == [2, 6]
    st = tr.stats(tr.select(reqs, sessions_n=1), scale=4)
    # blocks 0,1,2 | 0,1,2,3 | 0,1,2,3,4: 12 blocks used, 5 distinct
    assert st["distinct_blocks"] == 5 and st["block_reuse"] == pytest.approx(7 / 12)
    # each request's longest seen prefix: 0, 3 and 4 blocks (of 300, 450, 600 tokens)
    assert st["prefix_hit_bound"] == pytest.approx((3 * 128 + 4 * 128) / 1350)
    assert st["working_set_tokens"] == 5 * 128 and st["prompt_tokens"] == (1200 + 1800 + 2400) // 4


def test_trace_prompts_share_exactly_the_shared_blocks():
    from vllm_layerwise_patch.bench import trace as tr

    a, b, c, _, e, f = tr.parse(TRACE)
    pa, pc, pe = (tr.prompt(r, scale=4, vocab=(3, 1024)) for r in (a, c, e))
    assert (len(pa), len(pc), len(pe)) == (300, 450, 600)
    assert pc[:300] == pa and pe[:450] == pc  # the same hash ids: the same tokens
    pb = tr.prompt(b, scale=4)
    assert pb[:128] == pa[:128] and pb[128:256] != pa[128:256]  # only block 0 shared
    assert tr.prompt(f, scale=4)[:225] == pb  # a later turn of session (0,7)
    assert all(3 <= t < 1024 for t in pe)
    assert tr.prompt(a, scale=4, salt=1)[:128] != pa[:128]
    assert tr.output_length(a, 4) == 2 and tr.output_length(a, 1, cap=3) == 3
    with pytest.raises(ValueError, match="--scale must divide 512"):
        tr.prompt(a, scale=3)


def _trace_result(hbm, pool, tokens, cap=None, evictions=0.0):
    total = 1000.0
    r = {"requests": len(tokens), "seconds": 1.0,
         "ttft_s": {"avg": 0.2, "p50": 0.2, "p90": 0.3, "p99": 0.4},
         "prompt_tokens_by_source": {"local_compute": total * (1 - hbm - pool),
                                     "local_cache_hit": total * hbm,
                                     "external_kv_transfer": total * pool},
         "hit_rate": {"hbm": hbm, "pool": pool},
         "pool": {"evictions": evictions, "skipped_saves": 0.0, "failed_loads": 0.0,
                  "hit_tokens": total * pool}, "tokens": tokens}
    if cap:
        r["capacity_bytes"], r["pool_used_bytes"] = cap, cap * 0.9
    return r


def test_trace_capacity_sweep_report_and_token_equality(tmp_path):
    from vllm_layerwise_patch.bench.replay import finish
    from vllm_layerwise_patch.bench.trace_report import markdown, plot

    ref = [[1, 2], [3, 4], [5, 6]]
    results = {"no-prefix-cache": _trace_result(0, 0, [[1, 2], [3, 9], [5, 6]]),
               "hbm": _trace_result(0.2, 0, ref),
               "pool@64MiB": _trace_result(0.2, 0.1, ref, 64 << 20, evictions=40),
               "pool@256MiB": _trace_result(0.2, 0.35, [[1, 2], [3, 4], [0, 0]], 256 << 20)}
    results["hbm"]["exact_check"] = {"tokens": ref[:2], "hit_tokens": {}}
    results["pool@256MiB"]["exact_check"] = {"tokens": [[1, 2], [3, 5]], "hit_tokens": {
        "local_cache_hit": 10.0, "external_kv_transfer": 300.0, "local_compute": 5.0}}
    results["pool@256MiB+restart"] = {"error": "RuntimeError: boom"}
    doc = finish(results, ["64MiB", "256MiB"], exact=2)
    assert [p["capacity"] for p in doc["capacity_sweep"]] == ["64MiB", "256MiB"]
    assert doc["results"]["no-prefix-cache"]["same_tokens_as_hbm"]["equal"] == 2
    assert doc["results"]["pool@256MiB"]["same_tokens_as_hbm"]["fraction"] == pytest.approx(2 / 3)
    assert doc["exact_check"]["same_tokens"] == {"equal": 1, "of": 2, "fraction": 0.5}
    assert doc["exact_check"]["pool_hit_tokens"] == 300.0
    assert all("tokens" not in r for r in doc["results"].values())
    doc.update(trace={"file": "t.jsonl", "selection": {"sessions": 2}, "stats": {
        "requests": 3, "sessions": 2, "prompt_tokens": 1000, "distinct_blocks": 9,
        "working_set_tokens": 1152, "block_reuse": 0.6,
        "prefix_hit_bound": 0.58}},
        setup={"scale": 4, "block_tokens": 128, "concurrency": 4, "kv_cache_bytes": 1 << 20,
               "hbm_tokens": 256, "output": "x"}, model="m", machine="x", notes=[])
    text = markdown(doc)
    assert "| pool@64MiB | 64 MiB | 20.0% | 10.0% | 30.0% |" in text
    assert "At pool capacity 256MiB: token hit rate 55.0% (20.0% HBM + 35.0% pool) " \
           "against 20.0% with vLLM's HBM cache alone." in text
    assert "**1/2** requests with the same tokens" in text
    assert "error: RuntimeError: boom" in text
    pytest.importorskip("matplotlib")
    (png,) = plot(doc, str(tmp_path))
    assert png.endswith("hit_rate_vs_capacity.png") and (tmp_path / png).stat().st_size > 0


def test_trace_errors_are_clear(tmp_path):
    from vllm_layerwise_patch.bench import main

    bad = tmp_path / "t.jsonl"
    bad.write_text(TRACE[0] + "\n" + '{"timestamp": 0}\n')
    with pytest.raises(SystemExit, match="trace line 2: missing field 'input_length'"):
        main(["--trace", str(bad), "--model", "x", "--out", str(tmp_path / "o")])
    bad.write_text("\n".join(TRACE))
    with pytest.raises(SystemExit, match="the selection is empty"):
        main(["--trace", str(bad), "--model", "x", "--sessions", "0",
              "--out", str(tmp_path / "o")])


@pytest.mark.vllm
@pytest.mark.slow  # (default set: test_server.py serves from the pool)
def test_trace_replay_through_vllm_serve_hits_the_pool_after_hbm_evicts(tiny_model_dir,
                                                                        tmp_path):
    """The replay's real path, one server: vLLM's cache holds under 4 blocks of
    640 tokens (2 MiB: 2,457 tokens); A (3 blocks), two unrelated 4-block
    requests that evict A's blocks, then B, a later turn of A's session. B's
    shared blocks come from the pool
    (vLLM's own counter says so: the evictions left HBM nothing of A), and
    every request's tokens equal the same request's sent again one at a time."""
    from vllm_layerwise_patch.bench import trace as tr
    from vllm_layerwise_patch.bench.replay import ReplaySetup, run_config

    reqs = tr.parse([_line(0, 1536, [0, 1, 2], out=3), _line(1, 2000, [10, 11, 12, 13], out=3),
                     _line(2, 2000, [20, 21, 22, 23], out=3),
                     _line(3, 1800, [0, 1, 2, 3], out=3)])
    s = ReplaySetup(model=str(tiny_model_dir), work=tmp_path, requests=reqs, scale=1,
                    concurrency=1, kv_cache_bytes=2 << 20, max_model_len=2048,
                    max_num_batched_tokens=640)
    r = run_config(s, "pool@64MiB", "64MiB", exact=4)
    assert r["requests"] == 4 and all(len(t) == 3 for t in r["tokens"])
    assert r["ttft_s"]["p99"] is not None
    by = r["prompt_tokens_by_source"]
    assert by["external_kv_transfer"] == 1280  # A's two full 640-token blocks, for B
    assert by["local_cache_hit"] == 0
    assert r["pool"]["hit_tokens"] == 1280
    assert r["exact_check"]["tokens"] == r["tokens"]

def test_trace_counters_sum_labelled_samples():
    from vllm_layerwise_patch.bench.replay import sample_sum

    text = "\n".join([
        "# TYPE vllm:prompt_tokens_by_source_total counter",
        'vllm:prompt_tokens_by_source_total{engine="0",source="local_cache_hit"} 640.0',
        'vllm:prompt_tokens_by_source_total{engine="1",source="local_cache_hit"} 128.0',
        'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 5.0',
        "vllm:layerwise_pool_evictions_total 3.0"])
    assert sample_sum(text, "vllm:prompt_tokens_by_source_total",
                      source="local_cache_hit") == 768.0
    assert sample_sum(text, "vllm:prompt_tokens_by_source_total") == 773.0
    assert sample_sum(text, "vllm:layerwise_pool_evictions_total") == 3.0
    assert sample_sum(text, "vllm:layerwise_pool") == 0.0  # whole names only


def test_trace_open_loop_sends_at_the_scaled_timestamps():
    """``--time-scale``: each request leaves at its timestamp (not after the
    one before: the server here takes 0.3 s a request), and its TTFT counts
    from that arrival. The server is a stdlib stand-in streaming vLLM's
    completion chunks (``token_ids`` per chunk)."""
    import json
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from vllm_layerwise_patch.bench.replay import replay

    arrivals = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            arrivals.append((time.perf_counter(), body["prompt"][0]))
            assert body["stream"] and body["return_token_ids"] and body["ignore_eos"]
            time.sleep(0.3)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for t in range(body["max_tokens"]):
                chunk = {"choices": [{"text": "x", "token_ids": [body["prompt"][0] + t]}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        t0 = time.perf_counter()
        out = replay(f"http://127.0.0.1:{srv.server_address[1]}", "m", [[10], [20], [30]],
                     [2, 1, 3], timestamps_s=[0.0, 0.1, 0.2])
    finally:
        srv.shutdown()
    assert [o["tokens"] for o in out] == [[10, 11], [20], [30, 31, 32]]
    sent = {p: t - t0 for t, p in arrivals}
    assert sent[20] == pytest.approx(0.1, abs=0.08) and sent[30] == pytest.approx(0.2, abs=0.08)
    assert all(0.3 <= o["ttft"] < 1.0 for o in out)
