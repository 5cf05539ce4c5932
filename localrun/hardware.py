"""What this machine can hold and run: RAM, GPU memory, CPU cores and SIMD features.

`probe()` is cheap after the first call (cached; `refresh=True` reads again). Each part
degrades to "unknown" rather than failing: a machine without NVIDIA drivers, a
container without /proc/cpuinfo or a Mac without mlx still gets an answer.

Sources: psutil for RAM and cores; on Apple Silicon, mlx's Metal device info (unified
memory size and Metal's recommended working set, the most a GPU process should hold);
NVIDIA VRAM through NVML (pynvml, when installed) or `nvidia-smi`; SIMD flags from
/proc/cpuinfo on Linux, sysctl on macOS.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

GIB = 1 << 30


@dataclass(frozen=True)
class GPU:
    name: str
    kind: str  # "cuda" | "metal"
    total_bytes: int
    free_bytes: int  # what a new process may use: free VRAM, or Metal's recommended working set


@dataclass(frozen=True)
class Hardware:
    os: str
    machine: str
    ram_total: int
    ram_available: int
    cpu_physical: int
    cpu_logical: int
    cpu_name: str
    simd: tuple[str, ...]
    gpus: tuple[GPU, ...] = field(default=())
    unified_memory: bool = False  # Apple Silicon: the GPU shares the system RAM

    @property
    def gpu_free(self) -> int:
        return sum(g.free_bytes for g in self.gpus)

    @property
    def discrete_gpu(self) -> bool:
        return bool(self.gpus) and not self.unified_memory


_CACHE: Hardware | None = None

# Flags llama.cpp's CPU kernels choose between, in the order people look for them.
_X86_FLAGS = ("sse3", "ssse3", "avx", "avx2", "f16c", "fma", "avx_vnni", "avx512f", "avx512bw",
              "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
_ARM_FLAGS = ("asimd", "asimddp", "sve", "sve2", "i8mm", "bf16", "fphp", "asimdhp")


def probe(refresh: bool = False) -> Hardware:
    global _CACHE
    if _CACHE is None or refresh:
        _CACHE = _probe()
    return _CACHE


def _probe() -> Hardware:
    import psutil

    vm = psutil.virtual_memory()
    gpus: list[GPU] = []
    unified = sys.platform == "darwin" and platform.machine() == "arm64"
    if unified:
        metal = _metal_gpu()
        if metal:
            gpus.append(metal)
    else:
        gpus += _nvidia_gpus()
    return Hardware(
        os=f"{platform.system()} {platform.release()}",
        machine=platform.machine(),
        ram_total=int(vm.total),
        ram_available=int(vm.available),
        cpu_physical=int(psutil.cpu_count(logical=False) or os.cpu_count() or 1),
        cpu_logical=int(psutil.cpu_count(logical=True) or os.cpu_count() or 1),
        cpu_name=_cpu_name(),
        simd=_simd_flags(),
        gpus=tuple(gpus),
        unified_memory=unified,
    )


def _metal_gpu() -> GPU | None:
    try:
        import mlx.core as mx

        if not mx.metal.is_available():
            return None
        info = mx.metal.device_info() if hasattr(mx.metal, "device_info") else mx.device_info()
        total = int(info.get("memory_size", 0))
        working_set = int(info.get("max_recommended_working_set_size", total))
        return GPU(str(info.get("device_name", "Apple GPU")), "metal", total, working_set)
    except Exception:  # mlx missing or too old: no Metal figures, the CPU path still works
        return None


def parse_nvidia_smi(text: str) -> list[GPU]:
    """Rows of `nvidia-smi --query-gpu=name,memory.total,memory.free --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.rsplit(",", 2)]
        if len(parts) != 3:
            continue
        try:
            total, free = int(float(parts[1])) << 20, int(float(parts[2])) << 20  # MiB
        except ValueError:
            continue  # "[N/A]" on some virtualised GPUs
        gpus.append(GPU(parts[0], "cuda", total, free))
    return gpus


def _nvidia_gpus() -> list[GPU]:
    try:
        import pynvml  # optional: the NVML binding answers without spawning a process

        pynvml.nvmlInit()
        try:
            out = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                name = pynvml.nvmlDeviceGetName(h)
                out.append(GPU(name.decode() if isinstance(name, bytes) else str(name), "cuda",
                               int(mem.total), int(mem.free)))
            return out
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no pynvml or no driver: try the command-line tool
        pass
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        res = subprocess.run([exe, "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_nvidia_smi(res.stdout) if res.returncode == 0 else []


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def parse_cpuinfo(text: str) -> tuple[str, tuple[str, ...]]:
    """(model name, SIMD flags llama.cpp cares about) from /proc/cpuinfo text."""
    name, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not name:
            name = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    known = _X86_FLAGS if "avx" in flags or "sse3" in flags or "pni" in flags else _ARM_FLAGS
    found = [f for f in known if f in flags or (f == "sse3" and "pni" in flags)]
    return name, tuple(found)


def _cpu_name() -> str:
    if sys.platform == "darwin":
        return _sysctl("machdep.cpu.brand_string") or platform.processor() or platform.machine()
    return parse_cpuinfo(_read("/proc/cpuinfo"))[0] or platform.processor() or platform.machine()


def _sysctl(key: str) -> str:
    try:
        res = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5)
        return res.stdout.strip() if res.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _simd_flags() -> tuple[str, ...]:
    if sys.platform.startswith("linux"):
        return parse_cpuinfo(_read("/proc/cpuinfo"))[1]
    if sys.platform == "darwin" and platform.machine() == "arm64":
        flags = ["neon"]
        for feat, name in (("FEAT_DotProd", "dotprod"), ("FEAT_I8MM", "i8mm"), ("FEAT_BF16", "bf16")):
            if _sysctl(f"hw.optional.arm.{feat}") == "1":
                flags.append(name)
        return tuple(flags)
    return ()


def format_bytes(n: float) -> str:
    return f"{n / GIB:.1f} GB" if n >= GIB else f"{n / (1 << 20):.0f} MB"


# -- default thread counts: two numbers for two kinds of work -------------------------


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, else every CPU): the threads for
    independent pieces of work, such as quantizing rows in parallel."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def inference_threads() -> int:
    """Threads for a model's forward pass (llama.cpp's n_threads): one per physical core,
    at most one per usable CPU. Its matrix kernels gain nothing from a core's second
    hardware thread, and every graph node ends at a barrier that waits for the slowest
    thread, so a thread without a CPU of its own stalls them all."""
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
    except Exception:  # psutil missing or unable to read the topology
        physical = None
    usable = usable_cpus()
    return max(1, min(physical or usable, usable))


# -- threads that fit the machine's load ---------------------------------------------

# A core that other processes keep busy more than this share of the time is theirs: a
# llama.cpp thread placed on it waits for the CPU at every barrier, and all threads wait
# for it (measured here: SmolLM2 at 2 threads with one core taken, 23 tok/s; at 1, 46).
BUSY_CORE_SHARE = 0.5
LOAD_WINDOW_S = 0.1  # shorter readings of the others' load are noise (a 10 ms tick is 10%)


def fitted_threads(others_busy_cores: float | None, cores: int | None = None) -> int:
    """Threads for a forward pass on a shared machine: the physical cores
    (`inference_threads()`, or `cores`) less the cores other processes keep busy
    (`others_busy_cores`: the CPU time they used over a recent window divided by the
    window, e.g. 1.0 for one spinning process), each counted once its share passes
    BUSY_CORE_SHARE. At least 1, at most `cores`; None (unknown load) gives all cores."""
    cores = inference_threads() if cores is None else max(1, int(cores))
    if others_busy_cores is None:
        return cores
    taken = int(max(0.0, others_busy_cores) + (1.0 - BUSY_CORE_SHARE))  # 0.49 -> 0, 0.51 -> 1
    return max(1, min(cores, cores - taken))


class OthersLoad:
    """How many of our CPUs other processes kept busy since the last reading: the busy
    time of the CPUs this process may use (psutil's per-CPU times: everything but idle
    and iowait; steal counts as taken) minus this process's own CPU time over the same
    window. Reading costs ~0.1 ms and never blocks, so a backend can read it at load
    and between steps; its own threads' spinning is its own time, never the others'."""

    def __init__(self) -> None:
        self._cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        self._mark = self._now()

    def _now(self) -> tuple[float, float, float] | None:
        import time

        try:
            import psutil

            per_cpu = psutil.cpu_times(percpu=True)
        except Exception:  # psutil missing, or no per-CPU counters on this system
            return None
        if self._cpus is not None and all(i < len(per_cpu) for i in self._cpus):
            per_cpu = [per_cpu[i] for i in self._cpus]
        busy = sum(sum(t) - t.idle - getattr(t, "iowait", 0.0) for t in per_cpu)
        return time.monotonic(), busy, time.process_time()

    def busy_cores(self, wait: bool = False) -> float | None:
        """Cores' worth of CPU the others used since the last reading (which this one
        replaces); None when unknown, or when under LOAD_WINDOW_S has passed (then the
        window keeps growing), unless `wait`, which sleeps out the rest of the window."""
        import time

        if self._mark is None:
            return None
        if wait:
            time.sleep(max(0.0, self._mark[0] + LOAD_WINDOW_S - time.monotonic()))
        now = self._now()
        if now is None or now[0] - self._mark[0] < LOAD_WINDOW_S:
            return None
        (t0, busy0, own0), (t1, busy1, own1) = self._mark, now
        self._mark = now
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)
