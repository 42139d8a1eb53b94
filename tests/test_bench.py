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
