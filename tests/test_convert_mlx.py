"""GGUF -> MLX conversion: weights layout, tokenizer fidelity, atomic output.

The real checks run on the SmolLM2-135M test model (scripts/fetch_test_models.py puts
it in $LOCALRUN_TEST_MODELS, default ~/.cache/localrun/test-models) and compare the
converted model against llama.cpp running the very same GGUF (and a copy of it
with every tensor dequantized to F32).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from localrun.errors import LocalrunError, UnsupportedFormatError
from localrun.quant.gguf_to_mlx import convert_gguf_to_mlx, permute_qk, unpermute_qk
from localrun.quant.gguf_tokenizer import build_tokenizer

from conftest import FETCH_HINT, GEMMA3_GGUF as GEMMA, SMOLLM2_GGUF as SMOL  # one place for model paths

needs_smol = pytest.mark.skipif(not SMOL.is_file(), reason=f"{SMOL.name} is missing: {FETCH_HINT}")


def _partials(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if ".partial-" in p.name]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    if not SMOL.is_file():
        pytest.skip(f"{SMOL.name} is missing: {FETCH_HINT}")
    out = tmp_path_factory.mktemp("convert") / "smollm2-mlx"
    msgs: list[str] = []
    assert convert_gguf_to_mlx(SMOL, out, progress=msgs.append) == out
    assert msgs and msgs[-1].startswith("wrote")
    return out


@pytest.fixture(scope="module")
def mlx_model(converted):
    mlx_lm = pytest.importorskip("mlx_lm")
    return mlx_lm.load(str(converted))


@pytest.fixture(scope="module")
def smol_reader():
    if not SMOL.is_file():
        pytest.skip(f"{SMOL.name} is missing: {FETCH_HINT}")
    import gguf

    return gguf.GGUFReader(SMOL)


# --- the Q/K permutation -----------------------------------------------------------


@pytest.mark.parametrize("n_head,head_dim,cols", [(9, 64, 576), (3, 64, 576), (4, 8, 5), (2, 6, 1)])
def test_unpermute_inverts_llama_cpp_permutation(n_head, head_dim, cols):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n_head * head_dim, cols)).astype(np.float32)
    g = permute_qk(x, n_head)
    assert not np.array_equal(g, x)  # the test would be vacuous otherwise
    np.testing.assert_array_equal(unpermute_qk(g, n_head), x)
    # Independently of the reshape trick: within each head, GGUF row 2i is HF row i
    # and GGUF row 2i+1 is HF row i + head_dim/2.
    half = head_dim // 2
    for h in range(n_head):
        for i in range(half):
            np.testing.assert_array_equal(g[h * head_dim + 2 * i], x[h * head_dim + i])
            np.testing.assert_array_equal(g[h * head_dim + 2 * i + 1], x[h * head_dim + half + i])


def test_unpermute_on_1d_bias():
    x = np.arange(24, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(x, 3), 3), x)


def test_llama3_rope_scaling_recovered_from_rope_freqs():
    # mlx_lm's own Llama 3 rope is the independent reference: its frequencies divided
    # by the unscaled ones are the divisors llama.cpp stores as rope_freqs.
    import mlx.core as mx
    from mlx_lm.models.rope_utils import Llama3RoPE

    from localrun.quant.gguf_to_mlx import _llama3_rope_scaling

    want = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    rope = Llama3RoPE(64, base=500000.0, scaling_config=want)
    base = 500000.0 ** (mx.arange(0, 64, 2) / 64)
    divisors = np.array(rope._freqs / base, dtype=np.float32)
    assert _llama3_rope_scaling(divisors, 64, 500000.0) == want
    with pytest.raises(UnsupportedFormatError):
        _llama3_rope_scaling(divisors[::-1].copy(), 64, 500000.0)


# --- refusals ----------------------------------------------------------------------


@pytest.mark.skipif(not GEMMA.is_file(), reason=f"{GEMMA} absent")
def test_unsupported_architecture(tmp_path):
    out = tmp_path / "gemma-mlx"
    with pytest.raises(UnsupportedFormatError, match=r"architecture 'gemma3'.*supported: llama"):
        convert_gguf_to_mlx(GEMMA, out)
    assert not out.exists() and not _partials(tmp_path)


def test_not_a_gguf(tmp_path):
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"not a gguf at all")
    with pytest.raises(UnsupportedFormatError, match="malformed GGUF: bad magic"):
        convert_gguf_to_mlx(bogus, tmp_path / "out")


def test_existing_nonempty_dir_is_refused(tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(LocalrunError, match="not empty; choose another output path or remove it"):
        convert_gguf_to_mlx(SMOL, out)
    assert (out / "keep.txt").read_text() == "mine"
    assert not _partials(tmp_path)


@needs_smol
def test_interrupted_run_leaves_nothing(tmp_path):
    out = tmp_path / "half"

    def stop(msg: str) -> None:
        if msg.startswith("dequantized 64/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_gguf_to_mlx(SMOL, out, progress=stop)
    assert not out.exists() and not _partials(tmp_path)


# --- the converted folder ----------------------------------------------------------


def test_output_folder(converted):
    names = sorted(p.name for p in converted.iterdir())
    assert names == [
        "config.json", "generation_config.json", "model.safetensors",
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
    ]
    assert not _partials(converted.parent)

    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (576, 30, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["max_position_embeddings"] == 8192
    assert cfg["tie_word_embeddings"] is True  # SmolLM2's GGUF has no output.weight
    assert cfg["rope_theta"] == 100000.0 and cfg["torch_dtype"] == "float16"
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)

    tcfg = json.loads((converted / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"].startswith("{% for message in messages %}")
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == 2

    from safetensors import safe_open

    with safe_open(converted / "model.safetensors", framework="numpy") as f:
        assert f.metadata() == {"format": "mlx"}
        keys = set(f.keys())
        assert len(keys) == 2 + 30 * 9 and "lm_head.weight" not in keys
        q = f.get_slice("model.layers.0.self_attn.q_proj.weight")
        assert q.get_shape() == [576, 576] and q.get_dtype() == "F16"
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_slice("model.layers.0.mlp.down_proj.weight").get_shape() == [576, 1536]


def test_mlx_load_and_forward(mlx_model):
    import mlx.core as mx

    model, tok = mlx_model
    ids = tok.encode("The capital of France is")
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), 49152)
    assert mx.isfinite(logits).all().item()


# --- agreement with llama.cpp ------------------------------------------------------


TEXTS = [
    "Hello, world! How are you doing today?",
    "12345 and 3.14159, 1,000,000",
    "def f(x):\n    return x * 2\n\n\tif x:\n        pass  # done\n",
    "👋🌍",
    "你好世界",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing   ",
    "I'm sure HE'LL say we've naïve café résumé — ok?",
    "\n\n\nmultiple\r\nlines\n",
]


def _llama_cpp_tokenize(path: Path):
    """A tokenize(text) -> ids function backed by llama.cpp's own vocab (vocab only)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"llama.cpp could not load {path}"
    vocab = llama_cpp.llama_model_get_vocab(model)

    def tokenize(text: str, add_special: bool = False) -> list[int]:
        raw = text.encode()
        buf = (llama_cpp.llama_token * (len(raw) + 8))()
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, len(buf), add_special, True)
        assert n >= 0
        return list(buf[:n])

    return tokenize, lambda: llama_cpp.llama_model_free(model)


@pytest.fixture(scope="module")
def llama_tokenize():
    if not SMOL.is_file():
        pytest.skip(f"{SMOL.name} is missing: {FETCH_HINT}")
    tokenize, free = _llama_cpp_tokenize(SMOL)
    yield tokenize
    free()


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_llama_cpp(converted, llama_tokenize, text):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(converted / "tokenizer.json"))
    assert tok.encode(text).ids == llama_tokenize(text)


def _rewrite_pre(reader, pre: str, dest: Path, drop: tuple[str, ...] = ()) -> Path:
    """A vocab-only copy of the GGUF whose tokenizer.ggml.pre is `pre`, without `drop`."""
    import gguf

    w = gguf.GGUFWriter(dest, arch=reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop:
            continue
        value = pre if key == "tokenizer.ggml.pre" else field.contents()
        w.add_key_value(key, value, field.types[0], field.types[1] if len(field.types) > 1 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe"])
def test_other_pre_tokenizers_match_llama_cpp(smol_reader, tmp_path, pre):
    # Same vocabulary, other split rule: llama.cpp and our tokenizer must still agree.
    # Without add_bos_token in the file, both fall back to the pre-type's default
    # (BOS for Llama 3, none for GPT-2), so compare with special tokens added too.
    drop = ("tokenizer.ggml.add_bos_token",)
    path = _rewrite_pre(smol_reader, pre, tmp_path / f"{pre}.gguf", drop)
    meta = {k: f.contents() for k, f in smol_reader.fields.items() if k not in drop}
    meta["tokenizer.ggml.pre"] = pre
    ours = build_tokenizer(meta)
    tokenize, free = _llama_cpp_tokenize(path)
    try:
        for text in TEXTS:
            assert ours.encode(text, add_special_tokens=False).ids == tokenize(text), text
            assert ours.encode(text).ids == tokenize(text, add_special=True), text
    finally:
        free()
    assert (ours.encode("hi").ids[0] == 1) == (pre == "llama-bpe")


def _tiny_meta(**over):
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": ["a", "b", "ab", "<s>", "<x>"],
        "tokenizer.ggml.token_type": [1, 1, 1, 3, 4],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 3,
    }
    meta.update(over)
    return meta


def test_tiny_vocab_specials_and_bos():
    assert build_tokenizer(_tiny_meta()).encode("ab<x>a<s>").ids == [2, 4, 0, 3]
    with_bos = build_tokenizer(_tiny_meta(**{"tokenizer.ggml.add_bos_token": True}))
    assert with_bos.encode("ab").ids == [3, 2]


def test_unknown_tokenizers_are_refused():
    with pytest.raises(UnsupportedFormatError, match="pre-tokenizer 'falcon'"):
        build_tokenizer(_tiny_meta(**{"tokenizer.ggml.pre": "falcon"}))
    with pytest.raises(UnsupportedFormatError, match="tokenizer model is 'llama'"):
        build_tokenizer(_tiny_meta(**{"tokenizer.ggml.model": "llama"}))


PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 7 times 8?",
    "Name three primary colors.",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="module")
def prompt_ids(mlx_model) -> list[list[int]]:
    # The same ids go to both engines, so these tests compare weights, not tokenizers.
    # A one-line system message replaces SmolLM2's 20-token default one: shorter
    # prompts keep the CPU forward passes cheap.
    _, tok = mlx_model
    out = []
    for p in PROMPTS:
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": p}]
        ids = tok.apply_chat_template(chat, add_generation_prompt=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out


@pytest.fixture(scope="module")
def mlx_logits(mlx_model, prompt_ids) -> tuple[np.ndarray, np.ndarray]:
    """(logits at every position of prompt 0, logits after each prompt), float32.

    One batched pass over right-padded prompts: with causal attention a position
    never sees the padding after it, so every real position is exactly its unpadded
    result. The 49k-wide output layer is applied only to the positions compared,
    since on a CPU it costs a quarter of the whole pass.
    """
    import mlx.core as mx

    model, _ = mlx_model
    width = max(map(len, prompt_ids))
    batch = mx.array([ids + [0] * (width - len(ids)) for ids in prompt_ids])
    hidden = model.model(batch)
    head = getattr(model, "lm_head", None) or model.model.embed_tokens.as_linear
    first = head(hidden[0, : len(prompt_ids[0])])
    last = head(hidden[mx.arange(len(prompt_ids)), mx.array([len(i) - 1 for i in prompt_ids])])
    return np.array(first.astype(mx.float32)), np.array(last.astype(mx.float32))


def _llama_cpp(path: Path, **kw):
    llama_cpp = pytest.importorskip("llama_cpp")
    # One thread: for a 135M model it is fast enough, and llama.cpp's spinning worker
    # threads slow down badly when the CPU is shared (5x on a busy 2-core machine).
    llm = llama_cpp.Llama(
        str(path), n_ctx=128, n_threads=1, n_threads_batch=1, verbose=False, **kw
    )
    return llama_cpp, llm


@pytest.fixture(scope="module")
def dequantized_gguf(smol_reader, tmp_path_factory) -> Path:
    """The test GGUF with every tensor dequantized to F32, written by gguf-py alone.

    llama.cpp running this file computes exactly the function our converted weights
    should compute (same values, llama.cpp's own layout and rope), without the 8-bit
    rounding of activations llama.cpp applies when multiplying by Q4_1 weights.
    """
    import gguf
    from gguf.quants import dequantize

    dest = tmp_path_factory.mktemp("f32") / "smollm2-f32.gguf"
    w = gguf.GGUFWriter(dest, arch="llama")
    for key, field in smol_reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = 0 if key == "general.file_type" else field.contents()  # 0 = all F32
        w.add_key_value(key, value, field.types[0], field.types[1] if len(field.types) > 1 else None)
    for t in smol_reader.tensors:
        w.add_tensor(t.name, dequantize(t.data, t.tensor_type).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def test_same_function_as_llama_cpp_on_dequantized_weights(dequantized_gguf, prompt_ids, mlx_logits):
    # Every position of one prompt: many comparisons for a single llama.cpp pass.
    ids = prompt_ids[0]
    _, llm = _llama_cpp(dequantized_gguf, logits_all=True)
    try:
        llm.eval(ids)
        cpp = np.array(llm.scores[: len(ids)])
    finally:
        llm.close()
    ours = mlx_logits[0]
    assert (cpp.argmax(1) == ours.argmax(1)).mean() >= 0.9
    # A wrong Q/K permutation, norm or rope setting moves logits by whole units; the
    # float16 rounding of our weights moves them by hundredths.
    assert np.abs(cpp - ours).max() < 0.15


def test_greedy_next_token_matches_llama_cpp_q4_1(prompt_ids, mlx_logits):
    llama_cpp, llm = _llama_cpp(SMOL, logits_all=False)
    rows = []
    try:
        for ids in prompt_ids:
            llm.reset()
            llm.eval(ids)
            # llama-cpp-python 0.3.x fills llm.scores only with logits_all=True; read
            # the last position's logits from the context instead.
            ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            rows.append(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy())
    finally:
        llm.close()
    cpp = np.stack(rows)
    ours = mlx_logits[1]
    exact = cpp.argmax(1) == ours.argmax(1)
    # llama.cpp rounds activations to 8 bits before multiplying them by Q4_1 weights,
    # which we do not, so when its two best tokens are within a few tenths of a logit
    # the pick can flip. Count such a near-tie (our pick within 0.3 of llama.cpp's
    # best) as agreement; anything further apart is a conversion error.
    margin = cpp.max(1) - cpp[np.arange(len(ours)), ours.argmax(1)]
    agree = exact | (margin < 0.3)
    detail = list(zip(exact.tolist(), margin.round(3).tolist()))
    print("\nQ4_1 argmax agreement (exact, margin):", detail)
    assert sum(agree) >= 4, detail
    for row_cpp, row_ours in zip(cpp, ours):
        assert np.corrcoef(row_cpp, row_ours)[0, 1] > 0.99
