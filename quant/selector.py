"""Will a model fit, and which quant should this machine run?

Memory of a loaded model = weights + KV cache + compute buffers + runtime overhead:

- weights: the file sizes (GGUF: all split parts; MLX: the safetensors), split per
  layer by the tensor sizes in the header so a partial GPU offload can be priced;
- KV cache: 2 (K and V) x layers x cells x kv_heads x head_dim x bytes of the cache
  type (f16 2, q8_0 34/32, q4_0 18/32). Sliding-window layers hold their window
  (+ one micro-batch) where the backend keeps a windowed cache: MLX always does;
  llama.cpp only with `swa_full` off (localrun's llama.cpp backend keeps llama.cpp's
  default, the full-size cache, so those layers count at the full context there);
- compute buffers: what llama.cpp's scheduler reserves for one micro-batch (on a GPU
  the whole reservation is taken; on the CPU only the pages a pass touches become
  resident, so the activations and the logits rows actually written are counted);
- runtime overhead: the interpreter and the runtime libraries, measured
  (scripts/bench/fit_accuracy.py compares all of this with peak RSS).

Verdicts: "Full GPU" (every layer on the GPU), "Partial" (some layers on the GPU, the
rest in RAM), "CPU" (no usable GPU, fits in RAM), "Won't fit".
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from localrun.errors import BadRequestError, LocalrunError
from localrun.hardware import GIB, Hardware, format_bytes, probe
from localrun.backends.base import DEFAULT_N_BATCH
from localrun.model.formats import KV_CACHE_TYPES, kv_bytes_per_element, quality_rank
from localrun.backends.attention import MEASURE, attention_scores_bytes, flash_attention_choice

MIB = 1 << 20
# The llama.cpp backend's micro-batch: n_ubatch = n_batch, by default DEFAULT_N_BATCH (what
# run, chat and fit load with). `serve --batch` defaults to 256, which only shrinks these
# buffers, so a verdict made here also holds for a served model.
N_UBATCH = DEFAULT_N_BATCH
LLAMA_SWA_FULL = True  # backends/llamacpp.py keeps llama.cpp's default (full-size SWA cache)
# Measured with scripts/bench/fit_accuracy.py: RSS of the interpreter with each runtime imported
# (llama.cpp: 48 MiB for Python + the library, ~18 MiB of threads and graph metadata).
OVERHEAD = {"llama.cpp": 66 * MIB, "mlx": 150 * MIB}
# llama.cpp's vocabulary tables (token text, scores, the text->id map) and the engine's
# per-token tables: ~75 bytes a token, fitted on SmolLM2 (49k) and Gemma-3 (262k).
VOCAB_BYTES_PER_TOKEN = 75
# Tensor types llama.cpp's CPU backend repacks into an interleaved copy (x86 AVX2, ARM).
REPACKED_TYPES = frozenset({2, 12, 20})  # Q4_0, Q4_K, IQ4_NL
GPU_CONTEXT_OVERHEAD = 400 * MIB  # a CUDA context and cuBLAS workspace take this much VRAM
RAM_RESERVE = 512 * MIB  # left to the OS and the other programs when the budget is probed
VERDICTS = ("Full GPU", "Partial", "CPU", "Won't fit")


@dataclass(frozen=True)
class ModelShape:
    """The numbers of an architecture the memory model needs (not the weights)."""

    architecture: str
    n_layer: int
    n_ctx_train: int
    n_embd: int
    n_ff: int
    n_vocab: int
    kv_heads: tuple[int, ...]  # per layer (0 for layers without attention)
    head_dim_k: int
    head_dim_v: int
    swa: tuple[bool, ...]  # per layer: sliding-window attention
    sliding_window: int | None
    layer_share: tuple[float, ...]  # each block's share of the weight bytes
    backend: str  # "llama.cpp" | "mlx"
    repack_share: float = 0.0  # share of the weight bytes the CPU backend copies into repacked form
    n_head: int = 0  # query heads (the attention scores without flash attention)


def shape_from_gguf(metadata: dict, tensors) -> ModelShape:
    """From a GGUF header (metadata and tensor infos): the model facts
    (localrun.model.facts), with each block's share of the weight bytes."""
    from localrun.model.facts import gguf_facts

    f = gguf_facts(metadata, tensors)
    n_layer = f.n_layer
    if n_layer <= 0:
        raise BadRequestError(f"the GGUF header has no {f.architecture}.block_count; cannot size this model")
    per_layer = [0] * n_layer
    total = repacked = 0
    for t in tensors:
        total += t.nbytes
        if t.ggml_type in REPACKED_TYPES and t.name.startswith("blk."):
            repacked += t.nbytes
        if t.name.startswith("blk."):
            idx = t.name.split(".", 2)[1]
            if idx.isdigit() and int(idx) < n_layer:
                per_layer[int(idx)] += t.nbytes
    share = tuple(b / total for b in per_layer) if total else (1.0 / n_layer,) * n_layer
    return _shape(f, share, "llama.cpp", repacked / total if total else 0.0)


def shape_from_mlx_config(config: dict) -> ModelShape:
    from localrun.model.facts import mlx_config_facts

    f = mlx_config_facts(config)
    if f.n_layer <= 0:
        raise BadRequestError("config.json has no num_hidden_layers; cannot size this MLX model")
    return _shape(f, (1.0 / f.n_layer,) * f.n_layer, "mlx")


def _shape(f, layer_share: tuple[float, ...], backend: str, repack_share: float = 0.0) -> ModelShape:
    """The memory model's numbers from the model facts; 4096 tokens and a 4x feed-forward
    stand in where a file does not say."""
    return ModelShape(f.architecture, f.n_layer, f.context_length or 4096, f.n_embd, f.n_ff or 4 * f.n_embd,
                      f.n_vocab, f.kv_heads, f.head_dim, f.head_dim_v, f.swa_layers, f.sliding_window,
                      layer_share, backend, repack_share, f.n_head)


@functools.lru_cache(maxsize=64)
def _shape_cached(path: str, mtime: float) -> ModelShape:
    p = Path(path)
    if p.is_dir():
        import json

        return shape_from_mlx_config(json.loads((p / "config.json").read_text(encoding="utf-8")))
    from localrun.model.gguf_check import check_gguf

    summary = check_gguf(p)
    return shape_from_gguf(summary.metadata, summary.tensors)


def model_shape(path: Path) -> ModelShape:
    path = Path(path)
    return _shape_cached(str(path), path.stat().st_mtime)


def weights_bytes(path: Path) -> int:
    """All bytes a model loads: every split part, or every safetensors file."""
    path = Path(path)
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))
    from localrun.model.formats import split_parts

    return sum(p.stat().st_size for p in (split_parts(path) or [path]))


# -- the arithmetic -------------------------------------------------------------------


def kv_layer_bytes(shape: ModelShape, n_ctx: int, kv_type: str = "f16", n_seq: int = 1) -> list[float]:
    """The KV cache of each layer (it lives on the device holding that layer)."""
    per_elem = kv_bytes_per_element(kv_type)
    windowed = shape.backend == "mlx" or not LLAMA_SWA_FULL
    out = []
    for heads, is_swa in zip(shape.kv_heads, shape.swa):
        cells = n_ctx * n_seq
        if is_swa and windowed and shape.sliding_window:
            # llama.cpp pads the window by one micro-batch to 256 cells; mlx-lm's rotating cache holds the window
            pad = N_UBATCH if shape.backend == "llama.cpp" else 0
            cells = min(cells, -(-(shape.sliding_window * n_seq + pad) // 256) * 256)
        out.append(cells * heads * (shape.head_dim_k + shape.head_dim_v) * per_elem)
    return out


def kv_cache_bytes(shape: ModelShape, n_ctx: int, kv_type: str = "f16", n_seq: int = 1) -> int:
    return int(sum(kv_layer_bytes(shape, n_ctx, kv_type, n_seq)))


def compute_bytes(shape: ModelShape, n_ctx: int, on_gpu: bool) -> int:
    """Scheduler buffers for one micro-batch of N_UBATCH tokens.

    llama.cpp reserves logits for every row of a micro-batch (n_ubatch x n_vocab f32);
    a GPU takes all of it. On the CPU the pages only become resident when written, and
    the engine asks for the logits of the last row of a prompt, so what counts there is
    the activations (hidden and feed-forward rows), the attention mask (f16,
    n_ctx x n_ubatch, one per attention kind) and a few logits rows.
    """
    if shape.backend == "mlx":
        # MLX evaluates lazily; the peak is the feed-forward activations of one chunk plus logits rows
        return int(N_UBATCH * (shape.n_embd * 8 + shape.n_ff * 3) * 4 + 8 * shape.n_vocab * 4)
    activations = N_UBATCH * (shape.n_embd * 6 + shape.n_ff * 3) * 4
    masks = (2 if any(shape.swa) else 1) * n_ctx * N_UBATCH * 2
    logits_rows = N_UBATCH if on_gpu else 8
    return int(activations + masks + logits_rows * shape.n_vocab * 4)


def cpu_scores_bytes(shape: ModelShape, n_ctx: int, kv_type: str, n_seq: int, budget: "Budget") -> int:
    """The attention scores of one micro-batch, which llama.cpp keeps when flash attention
    is off: for an f16 cache on a machine without a GPU the llama.cpp backend may turn it
    off (where timing says it is faster: backends/attention_timing.py), so they count."""
    if shape.backend != "llama.cpp" or budget.vram > 0:
        return 0
    scores = attention_scores_bytes(N_UBATCH, n_ctx * n_seq, shape.n_head)
    return scores if flash_attention_choice(kv_type, on_cpu=True, score_bytes=scores) in ("off", MEASURE) else 0


@dataclass(frozen=True)
class Budget:
    """Memory the model may take: RAM (after a reserve) and, on a discrete GPU, VRAM."""

    ram: int
    vram: int = 0  # 0: no GPU to offload to
    unified: bool = False  # Apple Silicon: `vram` is Metal's working set inside `ram`
    source: str = "probed"
    repack: bool = True  # the CPU backend repacks Q4_0/Q4_K/IQ4_NL here (AVX2 or ARM)

    @classmethod
    def from_hardware(cls, hw: Hardware | None = None) -> "Budget":
        hw = hw or probe()
        ram = max(0, hw.ram_available - RAM_RESERVE)
        if hw.unified_memory:
            return cls(ram, min(ram, hw.gpu_free), True, repack=cpu_repacks(hw))
        vram = max(0, hw.gpu_free - GPU_CONTEXT_OVERHEAD) if hw.gpus else 0
        return cls(ram, vram, False, repack=cpu_repacks(hw))

    @classmethod
    def from_gb(cls, gb: float) -> "Budget":
        """`--memory GB`: that much free memory for the model, CPU only."""
        if gb <= 0:
            raise BadRequestError(f"--memory must be a positive number of GB, got {gb}")
        return cls(int(gb * GIB), 0, False, "--memory", cpu_repacks(probe()))

    def plus_workers(self, free: list[int]) -> "Budget":
        """This budget with the free memory of --rpc workers added to the RAM side: the
        combined memory a quant is chosen for (split_estimate then checks each device)."""
        return Budget(self.ram + sum(free), self.vram, self.unified, f"{self.source} + {len(free)} RPC workers",
                      self.repack)


@dataclass(frozen=True)
class Estimate:
    quant: str
    n_ctx: int
    kv_type: str
    weights: int
    kv: int
    buffers: int
    overhead: int
    budget: int  # the memory the verdict was judged against
    verdict: str
    gpu_layers: int  # layers on the GPU (n_gpu_layers); 0 on the CPU
    n_layer: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.buffers + self.overhead

    @property
    def fits(self) -> bool:
        return self.verdict != "Won't fit"

    def explain(self) -> str:
        kv = f" ({self.kv_type} KV)" if self.kv_type != "f16" else ""
        text = (f"{self.quant}: {format_bytes(self.weights)} weights + {format_bytes(self.kv)} KV @ {self.n_ctx}{kv}"
                f" + {format_bytes(self.buffers + self.overhead)} buffers = {format_bytes(self.total)}"
                f" of {format_bytes(self.budget)} free")
        if self.verdict == "Partial":
            text += f"; {self.gpu_layers} of {self.n_layer} layers on the GPU"
        return text


def estimate(shape: ModelShape, weights: int, n_ctx: int, budget: Budget, kv_type: str = "f16",
             quant: str = "?", n_seq: int = 1) -> Estimate:
    if kv_type not in KV_CACHE_TYPES:
        kv_bytes_per_element(kv_type)  # raises the one-line error
    kv = kv_cache_bytes(shape, n_ctx, kv_type, n_seq)
    overhead = OVERHEAD.get(shape.backend, OVERHEAD["llama.cpp"])
    if shape.backend == "llama.cpp":
        overhead += shape.n_vocab * VOCAB_BYTES_PER_TOKEN
    base = dict(quant=quant, n_ctx=n_ctx, kv_type=kv_type, weights=weights, kv=kv, overhead=overhead,
                n_layer=shape.n_layer)
    cpu_buffers = compute_bytes(shape, n_ctx, on_gpu=False) + cpu_scores_bytes(shape, n_ctx, kv_type, n_seq, budget)
    if budget.repack:
        cpu_buffers += int(weights * shape.repack_share)
    cpu_total = weights + kv + cpu_buffers + overhead
    if budget.vram <= 0 or (shape.backend == "mlx" and not budget.unified):
        verdict = "CPU" if cpu_total <= budget.ram else "Won't fit"
        return Estimate(**base, buffers=cpu_buffers, budget=budget.ram, verdict=verdict, gpu_layers=0)
    gpu_buffers = compute_bytes(shape, n_ctx, on_gpu=True)
    if weights + kv + gpu_buffers <= budget.vram and (not budget.unified or cpu_total <= budget.ram):
        return Estimate(**base, buffers=gpu_buffers, budget=budget.vram, verdict="Full GPU",
                        gpu_layers=shape.n_layer)
    if shape.backend == "mlx":  # MLX cannot split a model between GPU and CPU
        return Estimate(**base, buffers=gpu_buffers, budget=budget.vram, verdict="Won't fit", gpu_layers=0)
    # Partial offload: llama.cpp puts the last n_gpu_layers blocks on the GPU.
    kv_layer = [kv / shape.n_layer] * shape.n_layer
    room = budget.vram - gpu_buffers
    layers, used = 0, 0.0
    for i in reversed(range(shape.n_layer)):
        cost = weights * shape.layer_share[i] + kv_layer[i]
        if used + cost > room:
            break
        used, layers = used + cost, layers + 1
    rest = cpu_total - used if not budget.unified else cpu_total
    if rest > budget.ram:
        verdict = "Won't fit"
    elif layers == 0:
        verdict = "CPU"
    else:
        verdict = "Partial"
    return Estimate(**base, buffers=gpu_buffers if layers else cpu_buffers,
                    budget=budget.ram + (budget.vram if not budget.unified else 0),
                    verdict=verdict, gpu_layers=layers)


def cpu_repacks(hw: Hardware) -> bool:
    """Whether llama.cpp's CPU backend keeps repacked copies of Q4 weights on this CPU."""
    return "avx2" in hw.simd or hw.machine.lower() in ("arm64", "aarch64")


def largest_context(shape: ModelShape, weights: int, budget: Budget, kv_type: str = "f16",
                    quant: str = "?", n_seq: int = 1, draft: Path | None = None) -> Estimate | None:
    """The longest context (a multiple of 256, at most the trained one) that fits, or None.
    `draft`: a --draft model, which takes the same context and slots (without_draft)."""
    lo, hi = 0, max(1, shape.n_ctx_train // 256)
    best = None
    while lo < hi:  # find the largest k with a fitting estimate at k * 256
        mid = (lo + hi + 1) // 2
        left = budget if draft is None else without_draft(budget, draft, mid * 256, kv_type, n_seq)[0]
        est = estimate(shape, weights, mid * 256, left, kv_type, quant, n_seq)
        if est.fits:
            lo, best = mid, est
        else:
            hi = mid - 1
    return best if lo else None


@dataclass(frozen=True)
class Choice:
    pick: Estimate | None  # None: nothing fits even at 256 tokens
    estimates: tuple[Estimate, ...]  # every quant at the asked context and KV type
    note: str  # why the pick, one line


def choose(shape: ModelShape, quants: list[tuple[str, int]], n_ctx: int | None, budget: Budget,
           kv_type: str | None = None) -> Choice:
    """The best quant (by quality rank) that fits at `n_ctx`.

    When no f16 KV cache fits with the best weights, a q8_0 cache (near-lossless) is
    tried before a smaller weight quant; q4_0 only when nothing else fits. When no quant
    fits at the asked context at all, the best quant that loads gets the longest context
    that fits. `kv_type` given by the user is never changed.
    """
    if not quants:
        raise BadRequestError("no quants to choose from")
    ctx = int(n_ctx or min(4096, shape.n_ctx_train))
    asked = kv_type or "f16"
    ranked = sorted(quants, key=lambda q: (-quality_rank(q[0]), q[1]))
    estimates = tuple(estimate(shape, size, ctx, budget, asked, q) for q, size in quants)
    kv_tries = [asked] if kv_type else ["f16", "q8_0"]
    for q, size in ranked:
        for kv in kv_tries:
            est = estimate(shape, size, ctx, budget, kv, q)
            if est.fits:
                why = ("best quality that fits" if kv == asked
                       else f"a {kv} KV cache keeps {q} at {ctx} tokens: run it with --kv-cache-type {kv}")
                return Choice(est, estimates, why)
    if not kv_type:
        for q, size in ranked:
            est = estimate(shape, size, ctx, budget, "q4_0", q)
            if est.fits:
                return Choice(est, estimates, f"{ctx} tokens need a q4_0 KV cache: run it with --kv-cache-type q4_0")
    for q, size in ranked:
        best = largest_context(shape, size, budget, asked, q)
        if best is not None:
            return Choice(best, estimates, f"no quant fits {ctx} tokens; {q} fits {best.n_ctx}")
    return Choice(None, estimates, "nothing fits, not even 256 tokens of the smallest quant")


# -- one model over several machines (--rpc) ----------------------------------------


@dataclass(frozen=True)
class DeviceShare:
    """What one machine holds of a model split over llama.cpp RPC workers."""

    name: str  # "this machine" or a worker's host:port
    layers: int  # repeating layers (the output head is counted in `weights` where it lives)
    weights: int
    kv: int
    buffers: int  # compute buffers, plus the runtime's overhead on this machine
    free: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.buffers

    @property
    def fits(self) -> bool:
        return self.total <= self.free

    def explain(self) -> str:
        text = (f"{self.name}: {self.layers} layers, {format_bytes(self.weights)} weights + {format_bytes(self.kv)} KV"
                f" + {format_bytes(self.buffers)} buffers = {format_bytes(self.total)} of {format_bytes(self.free)} free")
        return text if self.fits else text + " (does not fit)"


def split_estimate(shape: ModelShape, est: Estimate, local_free: int, workers: list[tuple[str, int]],
                   tensor_split: tuple[float, ...] | None = None) -> list[DeviceShare]:
    """Each machine's part of `est` when its layers are split as the llama.cpp backend
    splits them (localrun.cluster.rpc.plan: by free memory, or --tensor-split; this machine keeps
    the first layers, the token embeddings and the output head: rpc.head_override)."""
    from localrun.cluster import rpc

    # one device a worker, so device i is worker i
    split, offloaded = rpc.split_layers(shape.n_layer, [], [[free] for _, free in workers], local_free, tensor_split)
    owners = rpc.layer_owners(shape.n_layer, offloaded, split)  # n_layer entries, then the output layer's
    kv_layers = kv_layer_bytes(shape, est.n_ctx, est.kv_type)
    holders = ["this machine"] + [name for name, _ in workers]
    weights, kv, layers = [0.0] * len(holders), [0.0] * len(holders), [0] * len(holders)
    for il in range(shape.n_layer):
        h = owners[il] + 1
        weights[h] += est.weights * shape.layer_share[il]
        kv[h] += kv_layers[il]
        layers[h] += 1
    # token embeddings, norms and the output head (a tied head maps the same file bytes)
    weights[0] += est.weights * max(0.0, 1.0 - sum(shape.layer_share))
    buffers = [compute_bytes(shape, est.n_ctx, on_gpu=False)] * len(holders)  # activations; logits stay here
    buffers[0] += est.overhead
    frees = [local_free] + [free for _, free in workers]
    return [DeviceShare(holders[i], layers[i], int(weights[i]), int(kv[i]), buffers[i], frees[i])
            for i in range(len(holders))]


def without_draft(budget: Budget, draft: Path, n_ctx: int | None, kv_type: str = "f16",
                  n_seq: int = 1) -> tuple[Budget, Estimate]:
    """The budget left for a model once its --draft model (weights, KV at the same
    context and slots, buffers: Engine.load_draft gives it the model's n_ctx and n_seq)
    has its share, and the draft's estimate: on the GPU when it fits there whole (it is
    placed first: a draft that spills to the CPU would cost more than it saves), else in RAM."""
    shape = model_shape(draft)
    ctx = int(n_ctx or min(4096, shape.n_ctx_train))
    est = estimate(shape, weights_bytes(draft), ctx, budget, kv_type, "draft", n_seq)
    on_gpu = est.verdict == "Full GPU"
    ram = budget.ram - (est.total if not on_gpu or budget.unified else 0)
    vram = budget.vram - (est.total if on_gpu else 0)
    left = Budget(max(0, ram), max(0, vram), budget.unified, f"{budget.source} less the draft model", budget.repack)
    return left, est


def fit_verdict(path: Path, n_ctx: int | None = None, kv_type: str = "f16", budget: Budget | None = None) -> str:
    """"Full GPU" | "Partial" | "CPU" | "Won't fit" for an installed model on this machine.

    n_ctx defaults to what `run` uses: min(4096, the trained context). A file that
    cannot be read answers "Won't fit" rather than raising, so listings never break.
    """
    try:
        shape = model_shape(Path(path))
        size = weights_bytes(Path(path))
    except (OSError, ValueError, LocalrunError):  # a malformed file: the listing still shows it
        return "Won't fit"
    ctx = int(n_ctx or min(4096, shape.n_ctx_train))
    return estimate(shape, size, ctx, budget or memory_from_env() or Budget.from_hardware(), kv_type).verdict


def memory_from_env() -> Budget | None:
    """LOCALRUN_MEMORY_GB pins the budget (tests, or a machine shared with other work)."""
    value = os.environ.get("LOCALRUN_MEMORY_GB")
    if not value:
        return None
    try:
        return Budget.from_gb(float(value))
    except ValueError:
        raise BadRequestError(f"LOCALRUN_MEMORY_GB must be a number of GB, got {value!r}") from None


__all__ = ["Budget", "Choice", "DeviceShare", "Estimate", "ModelShape", "VERDICTS", "choose", "estimate",
           "fit_verdict", "kv_cache_bytes", "kv_layer_bytes", "largest_context", "model_shape", "shape_from_gguf",
           "shape_from_mlx_config", "split_estimate", "weights_bytes", "without_draft"]
