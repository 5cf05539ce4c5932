"""The quant selector: names, quality order, the memory arithmetic, verdicts and the pick."""

from __future__ import annotations

import re

import pytest

from localrun.errors import BadRequestError
from localrun.hardware import GPU, Hardware
from localrun.model.formats import base_quant, bits_per_weight, quality_rank, quant_from_filename
from localrun.quant.selector import (
    Budget,
    ModelShape,
    choose,
    estimate,
    fit_verdict,
    kv_cache_bytes,
    largest_context,
    model_shape,
    shape_from_mlx_config,
    weights_bytes,
)

MIB, GIB = 1 << 20, 1 << 30


def llama_like(n_layer=32, kv_heads=8, head_dim=128, n_ctx_train=32768, backend="llama.cpp") -> ModelShape:
    """An 8B-class llama shape: 32 layers, 8 KV heads of 128."""
    return ModelShape("llama", n_layer, n_ctx_train, 4096, 14336, 128256, (kv_heads,) * n_layer, head_dim, head_dim,
                      (False,) * n_layer, None, (0.9 / n_layer,) * n_layer, backend)


@pytest.mark.parametrize("filename, quant", [
    ("Qwen2.5-7B-Instruct-Q4_K_M.gguf", "Q4_K_M"),
    ("qwen2.5-7b-instruct-q5_k_s.gguf", "Q5_K_S"),
    ("model.Q8_0.gguf", "Q8_0"),
    ("Llama-3.3-70B-Instruct-Q4_K_M-00001-of-00002.gguf", "Q4_K_M"),
    ("Meta-Llama-3-8B-UD-Q4_K_XL.gguf", "UD-Q4_K_XL"),
    ("gemma-3-270m-IQ2_XXS.gguf", "IQ2_XXS"),
    ("phi-4-IQ4_NL.gguf", "IQ4_NL"),
    ("Mistral-7B-v0.3-fp16.gguf", "F16"),
    ("granite-BF16.gguf", "BF16"),
    ("llama-2-7b-Q4_0_4_4.gguf", "Q4_0_4_4"),
    ("smollm2-135m-instruct.gguf", None),
    ("F16-merges/model-Q6_K.gguf", "Q6_K"),  # the file's own token wins over a folder name
])
def test_quant_names_from_file_names(filename, quant):
    assert quant_from_filename(filename) == quant


def test_quality_order_follows_published_kl_divergence():
    order = ["F16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "IQ4_XS", "Q4_0", "Q3_K_M",
             "IQ3_XXS", "Q2_K", "IQ2_XXS", "IQ1_S"]
    ranks = [quality_rank(q) for q in order]
    assert ranks == sorted(ranks, reverse=True), list(zip(order, ranks))
    assert quality_rank("Q4_K_M") > quality_rank("Q4_1") > quality_rank("Q4_0")  # K-quant beats legacy at ~4.5 bpw
    assert quality_rank("UD-Q4_K_XL") > quality_rank("Q4_K_M") > quality_rank("Q4_K_S")
    assert quality_rank("8bit") > quality_rank("6bit") > quality_rank("4bit") > quality_rank("3bit")
    assert quality_rank("Q4_K_M") > quality_rank("4bit")  # an MLX 4-bit sits with the legacy 4-bit quants
    assert quality_rank("nonsense") == 0.0
    assert base_quant("UD-Q4_K_XL") == "Q4_K_M" and bits_per_weight("Q4_K_M") == pytest.approx(4.89)
    assert bits_per_weight("4bit") == pytest.approx(4.5)


def test_kv_cache_of_the_real_models_matches_llama_cpp(smollm2_gguf, gemma3_gguf):
    """llama.cpp's own log: SmolLM2 45.00 MiB at 2048; Gemma-3 24 + 120 MiB at 8192 (full-size SWA cache)."""
    smol = model_shape(smollm2_gguf)
    assert (smol.n_layer, smol.kv_heads[0], smol.head_dim_k, smol.n_vocab) == (30, 3, 64, 49152)
    assert kv_cache_bytes(smol, 2048) == 45 * MIB
    assert kv_cache_bytes(smol, 8192) == 180 * MIB
    assert kv_cache_bytes(smol, 2048, "q8_0") == int(45 * MIB / 2 * 34 / 32)  # 34 bytes per 32 elements
    assert kv_cache_bytes(smol, 2048, "q4_0") == int(45 * MIB / 2 * 18 / 32)
    gemma = model_shape(gemma3_gguf)
    assert gemma.sliding_window == 512 and gemma.swa.count(True) == 15 and gemma.n_vocab == 262144
    assert [i for i, s in enumerate(gemma.swa) if not s] == [5, 11, 17]
    assert kv_cache_bytes(gemma, 8192) == 144 * MIB
    assert 0.25 < sum(gemma.layer_share) < 0.3  # the 262k-token embedding is most of this small model


def test_sliding_window_layers_count_at_their_window_on_mlx(gemma3_gguf):
    gemma = model_shape(gemma3_gguf)
    mlx_gemma = ModelShape(**{**gemma.__dict__, "backend": "mlx"})
    full_layers = 3 * 8192 * 256 * 2 * 2
    window_layers = 15 * 512 * 256 * 2 * 2
    assert kv_cache_bytes(mlx_gemma, 8192) == full_layers + window_layers
    assert kv_cache_bytes(mlx_gemma, 8192) < kv_cache_bytes(gemma, 8192) / 3


def test_shape_from_an_mlx_config(smollm2_mlx, smollm2_gguf):
    mlx, gguf = model_shape(smollm2_mlx), model_shape(smollm2_gguf)
    assert mlx.backend == "mlx" and kv_cache_bytes(mlx, 2048) == kv_cache_bytes(gguf, 2048)
    gemma_cfg = {"model_type": "gemma3_text", "num_hidden_layers": 6, "hidden_size": 640, "num_attention_heads": 4,
                 "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512,
                 "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    s = shape_from_mlx_config(gemma_cfg)
    assert s.swa == (True,) * 5 + (False,) and s.sliding_window == 512
    with pytest.raises(BadRequestError, match="num_hidden_layers"):
        shape_from_mlx_config({"model_type": "x"})


def test_cpu_verdicts_and_the_explanation():
    shape = llama_like()
    w = int(4.9 * GIB)
    fits = estimate(shape, w, 8192, Budget.from_gb(8), quant="Q4_K_M")
    assert fits.verdict == "CPU" and fits.kv == 1 * GIB  # 2 x 32 x 8192 x 8 x 128 x 2 bytes
    assert re.fullmatch(r"Q4_K_M: 4\.9 GB weights \+ 1\.0 GB KV @ 8192 \+ \d+ MB buffers = 6\.\d GB of 8\.0 GB free",
                        fits.explain()), fits.explain()
    assert estimate(shape, w, 8192, Budget.from_gb(5), quant="Q4_K_M").verdict == "Won't fit"
    with pytest.raises(BadRequestError, match="--kv-cache-type"):
        estimate(shape, w, 8192, Budget.from_gb(8), kv_type="q5_1")
    with pytest.raises(BadRequestError, match="--memory"):
        Budget.from_gb(0)


def test_gpu_verdicts_full_partial_cpu():
    shape = llama_like()
    w = int(4.9 * GIB)
    assert estimate(shape, w, 8192, Budget(ram=32 * GIB, vram=12 * GIB)).verdict == "Full GPU"
    partial = estimate(shape, w, 8192, Budget(ram=32 * GIB, vram=4 * GIB))
    assert partial.verdict == "Partial" and 0 < partial.gpu_layers < 32
    assert f"{partial.gpu_layers} of 32 layers on the GPU" in partial.explain()
    more = estimate(shape, w, 8192, Budget(ram=32 * GIB, vram=5 * GIB))
    assert more.gpu_layers > partial.gpu_layers  # more VRAM, more layers
    assert estimate(shape, w, 8192, Budget(ram=32 * GIB, vram=300 * MIB)).verdict == "CPU"  # not one layer fits
    assert estimate(shape, w, 8192, Budget(ram=1 * GIB, vram=2 * GIB)).verdict == "Won't fit"
    # Apple unified memory: the working set decides; MLX cannot split layers.
    assert estimate(shape, w, 8192, Budget(ram=16 * GIB, vram=11 * GIB, unified=True)).verdict == "Full GPU"
    mlx = llama_like(backend="mlx")
    assert estimate(mlx, w, 8192, Budget(ram=16 * GIB, vram=5 * GIB, unified=True)).verdict == "Won't fit"
    assert estimate(mlx, w, 8192, Budget(ram=16 * GIB, vram=12 * GIB)).verdict == "CPU"  # MLX never uses CUDA


def test_budget_from_hardware():
    cuda = Hardware("Linux", "x86_64", 32 * GIB, 20 * GIB, 8, 16, "cpu", ("avx2",),
                    (GPU("RTX 4070", "cuda", 12 * GIB, 11 * GIB),))
    b = Budget.from_hardware(cuda)
    assert b.vram == 11 * GIB - 400 * MIB and b.ram == 20 * GIB - 512 * MIB and not b.unified
    mac = Hardware("Darwin", "arm64", 16 * GIB, 12 * GIB, 8, 8, "M2", ("neon",),
                   (GPU("Apple M2", "metal", 16 * GIB, int(10.7 * GIB)),), unified_memory=True)
    b = Budget.from_hardware(mac)
    assert b.unified and b.vram == int(10.7 * GIB)
    cpu_only = Hardware("Linux", "x86_64", 8 * GIB, 6 * GIB, 4, 8, "cpu", ())
    assert Budget.from_hardware(cpu_only).vram == 0


QUANTS = [("Q8_0", int(8.5 * GIB)), ("Q6_K", int(6.6 * GIB)), ("Q5_K_M", int(5.7 * GIB)),
          ("Q4_K_M", int(4.9 * GIB)), ("Q3_K_M", int(3.9 * GIB)), ("Q2_K", int(3.2 * GIB))]


def test_choose_the_best_quant_that_fits():
    shape = llama_like()
    assert choose(shape, QUANTS, 4096, Budget.from_gb(64)).pick.quant == "Q8_0"
    pick = choose(shape, QUANTS, 4096, Budget.from_gb(7)).pick
    assert (pick.quant, pick.kv_type) == ("Q5_K_M", "f16")
    assert choose(shape, QUANTS, 4096, Budget.from_gb(4.5)).pick.quant == "Q3_K_M"
    assert choose(shape, list(reversed(QUANTS)), 4096, Budget.from_gb(7)).pick.quant == "Q5_K_M"  # order-free


def test_choose_proposes_a_q8_kv_cache_before_a_smaller_quant():
    shape = llama_like()
    # Q5_K_M at 32k: 4 GB of f16 KV does not fit in 8.5 GB; with q8_0 KV (2.1 GB) it does.
    choice = choose(shape, QUANTS, 32768, Budget.from_gb(8.5))
    assert (choice.pick.quant, choice.pick.kv_type) == ("Q5_K_M", "q8_0"), choice.note
    assert "q8_0 KV" in choice.note
    # Asked for f16 explicitly: the KV type stays, the weights shrink instead.
    fixed = choose(shape, QUANTS, 32768, Budget.from_gb(8.5), kv_type="f16")
    assert fixed.pick.kv_type == "f16" and quality_rank(fixed.pick.quant) < quality_rank("Q5_K_M")


def test_choose_falls_back_to_the_longest_context_that_fits():
    shape = llama_like(n_ctx_train=131072)
    choice = choose(shape, QUANTS, 131072, Budget.from_gb(6.5), kv_type="f16")
    assert choice.pick is not None and 0 < choice.pick.n_ctx < 131072 and choice.pick.n_ctx % 256 == 0
    assert "fits" in choice.note
    bigger = estimate(shape, dict(QUANTS)[choice.pick.quant], choice.pick.n_ctx + 256, Budget.from_gb(6.5))
    assert not bigger.fits  # the context found is the largest
    assert largest_context(shape, int(8.5 * GIB), Budget.from_gb(2)) is None
    nothing = choose(shape, QUANTS, 4096, Budget.from_gb(1))
    assert nothing.pick is None and len(nothing.estimates) == len(QUANTS)


def test_fit_verdict_of_real_files(smollm2_gguf, smollm2_mlx, tmp_path, monkeypatch):
    assert fit_verdict(smollm2_gguf, 2048, budget=Budget.from_gb(2)) == "CPU"
    assert fit_verdict(smollm2_gguf, 8192, budget=Budget.from_gb(0.25)) == "Won't fit"
    assert fit_verdict(smollm2_mlx, 2048, budget=Budget.from_gb(2)) == "CPU"
    monkeypatch.setenv("LOCALRUN_MEMORY_GB", "0.1")
    assert fit_verdict(smollm2_gguf) == "Won't fit"
    monkeypatch.setenv("LOCALRUN_MEMORY_GB", "4")
    assert fit_verdict(smollm2_gguf) in ("CPU", "Full GPU", "Partial")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 32)
    assert fit_verdict(broken) == "Won't fit"  # listings never crash on a bad file
    assert weights_bytes(smollm2_gguf) == smollm2_gguf.stat().st_size


# -- one model over several machines (--rpc) ------------------------------------------


def test_split_puts_layers_and_their_kv_where_the_free_memory_is():
    from localrun.quant.selector import split_estimate

    shape = llama_like()  # 32 layers, 90% of the bytes in the blocks
    est = estimate(shape, int(4.5 * GIB), 4096, Budget(64 * GIB))
    workers = [("10.0.0.2:50052", 8 * GIB), ("10.0.0.3:50052", 16 * GIB)]
    rows = split_estimate(shape, est, 8 * GIB, workers)
    # 8:8:16 of 33 slots (32 layers + the output head): this machine keeps the first 8 layers,
    # 25 go out, a third to the first worker (9) and the rest (15 + the head) to the second
    assert [(r.name, r.layers) for r in rows] == [("this machine", 8), ("10.0.0.2:50052", 9),
                                                  ("10.0.0.3:50052", 15)]
    assert sum(r.weights for r in rows) == pytest.approx(est.weights, rel=1e-6)
    assert sum(r.kv for r in rows) == pytest.approx(est.kv, rel=1e-6)
    assert rows[1].kv == pytest.approx(est.kv * 9 / 32, rel=1e-6)  # a layer's KV lives with the layer
    assert rows[0].buffers > rows[1].buffers  # the runtime's overhead counts on this machine only
    assert all(r.fits for r in rows)
    assert re.fullmatch(r"10\.0\.0\.3:50052: 15 layers, .* weights \+ .* KV \+ .* buffers = .* of 16\.0 GB free",
                        rows[2].explain())


def test_tensor_split_overrides_free_memory_and_a_full_device_says_so():
    from localrun.quant.selector import split_estimate

    shape = llama_like()
    est = estimate(shape, int(4.5 * GIB), 4096, Budget(64 * GIB))
    rows = split_estimate(shape, est, 64 * GIB, [("a:1", 64 * GIB), ("b:2", 1 * GIB)], (1.0, 0.0, 1.0))
    # half of 33 slots (32 layers + the head) rounds to 16 offloaded: 15 layers and the head
    assert [r.layers for r in rows] == [17, 0, 15]  # the first worker was given no share
    assert rows[1].weights == 0 and rows[1].kv == 0
    assert not rows[2].fits and rows[2].explain().endswith("(does not fit)")  # 2+ GB on a 1 GB worker


def test_budget_plus_workers_adds_their_memory_to_the_ram_side():
    b = Budget(8 * GIB, 0, False, "probed").plus_workers([4 * GIB, 2 * GIB])
    assert b.ram == 14 * GIB and b.vram == 0 and "2 RPC workers" in b.source

