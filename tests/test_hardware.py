"""The hardware probe: RAM, cores, SIMD flags, NVIDIA parsing, and `localrun doctor`."""

from __future__ import annotations

import importlib.util
import os
import stat
import sys

import pytest

from localrun.commands.store import backend_report
from localrun.hardware import parse_cpuinfo, parse_nvidia_smi, probe

X86_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Core(TM) i7-12700K
flags\t\t: fpu vme pni ssse3 fma avx f16c avx2 avx_vnni sse4_1
processor\t: 1
model name\t: Intel(R) Core(TM) i7-12700K
flags\t\t: fpu vme pni ssse3 fma avx f16c avx2 avx_vnni sse4_1
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp asimddp sve i8mm bf16
CPU implementer\t: 0x41
"""


def test_cpuinfo_flags():
    name, flags = parse_cpuinfo(X86_CPUINFO)
    assert name == "Intel(R) Core(TM) i7-12700K"
    assert flags == ("sse3", "ssse3", "avx", "avx2", "f16c", "fma", "avx_vnni")  # pni is SSE3
    assert "avx512f" not in flags
    _, arm = parse_cpuinfo(ARM_CPUINFO)
    assert {"asimd", "asimddp", "sve", "i8mm", "bf16"} <= set(arm) and "avx" not in arm
    assert parse_cpuinfo("") == ("", ())


def test_nvidia_smi_rows():
    text = "NVIDIA GeForce RTX 4090, 24564, 23012\nNVIDIA A100-SXM4-80GB, 81920, 80000\nGRID T4, [N/A], [N/A]\n"
    gpus = parse_nvidia_smi(text)
    assert [(g.name, g.total_bytes >> 20, g.free_bytes >> 20) for g in gpus] == [
        ("NVIDIA GeForce RTX 4090", 24564, 23012), ("NVIDIA A100-SXM4-80GB", 81920, 80000)]
    assert all(g.kind == "cuda" for g in gpus) and parse_nvidia_smi("") == []


def test_probe_reads_this_machine():
    hw = probe(refresh=True)
    assert hw.ram_total > 0 and 0 < hw.ram_available <= hw.ram_total
    assert 1 <= hw.cpu_physical <= hw.cpu_logical
    assert probe() is hw  # cached
    if sys.platform.startswith("linux") and os.path.exists("/proc/cpuinfo"):
        assert hw.simd, "a Linux CPU lists SIMD flags in /proc/cpuinfo"
    assert hw.gpu_free == sum(g.free_bytes for g in hw.gpus)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a fake nvidia-smi on PATH is a Linux test")
def test_nvidia_gpu_found_through_nvidia_smi(tmp_path, monkeypatch):
    if importlib.util.find_spec("pynvml") is not None:
        pytest.skip("pynvml is installed: NVML answers before nvidia-smi is consulted")
    tool = tmp_path / "nvidia-smi"
    tool.write_text("#!/bin/sh\necho 'NVIDIA GeForce RTX 4070, 12282, 11000'\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    try:
        hw = probe(refresh=True)
        assert [g.name for g in hw.gpus] == ["NVIDIA GeForce RTX 4070"] and hw.discrete_gpu
        assert hw.gpu_free == 11000 << 20
    finally:
        monkeypatch.undo()
        probe(refresh=True)  # later tests see the real machine again


def test_backend_report_names_both_runtimes():
    rows = dict(backend_report())
    assert rows["llama.cpp"].startswith("llama-cpp-python") and "build" in rows["llama.cpp"]
    assert rows["mlx"].startswith("mlx")


def test_backend_report_says_whether_rpc_workers_can_be_used():
    import llama_cpp

    row = dict(backend_report())["rpc"]
    if llama_cpp.llama_supports_rpc():
        assert row.startswith("available") and "rpc-worker" in row
    else:  # the CPU-only build: doctor says how to get RPC
        assert "built without GGML_RPC" in row and "scripts/setup.sh" in row


def test_doctor_prints_hardware_backends_and_folders(tmp_path, monkeypatch, capsys):
    from hubserver import run_cli

    monkeypatch.setenv("LOCALRUN_MODELS", str(tmp_path / "models"))
    assert run_cli(["doctor"]) == 0
    out = capsys.readouterr().out
    for label in ("cpu", "simd", "ram", "gpu", "llama.cpp", "rpc", "mlx", "models", "hf cache", "lm studio", "hub"):
        assert any(line.startswith(label + " ") for line in out.splitlines()), (label, out)
    assert str(tmp_path / "models") in out
