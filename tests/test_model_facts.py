"""One answer to "what is this model": localrun.model.facts, read from GGUF headers and MLX
folders, and the same answer for the store (`show`), /api/show, the selector and `pull`.

The expected numbers of the real test models are what the four old code paths computed
(store.model_facts, server/describe.py, the selector's shape_from_gguf /
shape_from_mlx_config, hub's remote header read) before they were folded into one; the
loaded llama.cpp backend is the referee for the numbers llama.cpp derives itself."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import threading

import gguf
import numpy as np
import pytest

from localrun.errors import MalformedModelError, UnsupportedFormatError
from localrun.model.gguf_header import NeedMoreBytes, read_header_prefix
from localrun.model.facts import ModelFacts, facts, gguf_facts, mlx_config_facts

SMOL = dict(architecture="llama", n_params=134_515_008, context_length=8192, n_layer=30, n_head=9, n_head_kv=3,
            head_dim=64, head_dim_v=64, n_embd=576, n_ff=1536, n_vocab=49152, sliding_window=None,
            fim_prefix_id=None, fim_suffix_id=None, fim_middle_id=None, pooling_type=None)
EXPECTED = {
    "smollm2_gguf": dict(SMOL, format="gguf", quant="Q4_1", file_type=3),
    "smollm2_mlx": dict(SMOL, format="mlx", quant="F16", file_type=None),
    "gemma3_gguf": dict(format="gguf", architecture="gemma3", n_params=268_098_176, quant="Q4_K_M", file_type=15,
                        context_length=32768, n_layer=18, n_head=4, n_head_kv=1, head_dim=256, head_dim_v=256,
                        n_embd=640, n_ff=2048, n_vocab=262_144, sliding_window=512, fim_prefix_id=None,
                        fim_suffix_id=None, fim_middle_id=None, pooling_type=None),
    "qwen_coder_gguf": dict(format="gguf", architecture="qwen2", n_params=630_167_424, quant="Q4_K_M", file_type=15,
                            context_length=32768, n_layer=24, n_head=14, n_head_kv=2, head_dim=64, head_dim_v=64,
                            n_embd=896, n_ff=4864, n_vocab=151_936, sliding_window=None,
                            # no FIM keys in its metadata: found by their text, as llama.cpp does
                            fim_prefix_id=151_659, fim_suffix_id=151_661, fim_middle_id=151_660, pooling_type=None),
}
GEMMA_SWA = (True,) * 5 + (False,)  # llama.cpp's gemma3 default: every 6th layer is global


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_facts_of_the_test_models(request, model):
    f = facts(request.getfixturevalue(model))
    for field, want in EXPECTED[model].items():
        assert getattr(f, field) == want, field
    assert f.kv_heads == (f.n_head_kv,) * f.n_layer
    assert f.swa_layers == (GEMMA_SWA * 3 if model == "gemma3_gguf" else (False,) * f.n_layer)
    assert f.has_fim == (model == "qwen_coder_gguf")  # the one code model


def test_chat_templates_and_tools(smollm2_gguf, smollm2_mlx, gemma3_gguf, qwen_coder_gguf):
    smol, mlx, gemma, qwen = (facts(p) for p in (smollm2_gguf, smollm2_mlx, gemma3_gguf, qwen_coder_gguf))
    assert smol.chat_template.startswith("{% for message in messages %}") and "<|im_start|>" in smol.chat_template
    assert mlx.chat_template == smol.chat_template  # tokenizer_config.json holds the same template
    assert gemma.chat_template is None and not gemma.has_tools  # this Gemma GGUF carries no template
    assert qwen.chat_template.startswith("{%- if tools %}") and qwen.has_tools
    assert not smol.has_tools


def test_gguf_and_mlx_smollm2_are_the_same_model(smollm2_gguf, smollm2_mlx):
    a, b = dataclasses.asdict(facts(smollm2_gguf)), dataclasses.asdict(facts(smollm2_mlx))
    assert {k for k in a if a[k] != b[k]} == {"format", "quant", "file_type"}


@pytest.mark.parametrize("model", ["smollm2_gguf", "gemma3_gguf", "qwen_coder_gguf"])
def test_facts_agree_with_the_loaded_llama_cpp_model(request, model):
    """llama.cpp derives these itself when it loads the file: the header read must agree."""
    from localrun.engine import Engine

    path = request.getfixturevalue(model)
    f = facts(path)
    with Engine.open(path, n_ctx=256) as eng:
        info = eng.info
        assert (f.architecture, f.n_params, f.quant, f.context_length) == (
            info.architecture, info.n_params, info.quant, info.n_ctx_train)
        assert (f.n_layer, f.n_head, f.n_head_kv, f.head_dim, f.n_vocab, f.sliding_window) == (
            info.n_layer, info.n_head, info.n_head_kv, info.head_dim, info.n_vocab, info.sliding_window)
        assert (f.fim_prefix_id, f.fim_suffix_id, f.fim_middle_id) == (
            info.fim_prefix_id, info.fim_suffix_id, info.fim_middle_id)
        assert f.chat_template == info.chat_template


def test_the_remote_header_gives_the_same_facts(gemma3_gguf):
    """`pull` reads a prefix of the remote file: the facts are the local file's."""
    size, data = gemma3_gguf.stat().st_size, gemma3_gguf.read_bytes()
    want, reads = 4 << 20, 0
    while True:  # hub.remote_header's loop, without the HTTP
        reads += 1
        try:
            header = read_header_prefix(data[:want], size, "remote")
            break
        except NeedMoreBytes as more:
            want = max(want * 4, more.at_least)
    assert reads == 2  # 262k tokens do not fit in 4 MiB
    assert gguf_facts(header.metadata, header.tensors) == facts(gemma3_gguf)


def test_every_reader_answers_the_same(smollm2_gguf, smollm2_mlx, gemma3_gguf, qwen_coder_gguf):
    """The store's `show`, /api/show's description and the selector's shape read one set of facts."""
    from localrun.quant.selector import model_shape
    from localrun.server.describe import describe
    from localrun.store.local import model_facts as show_facts

    for path in (smollm2_gguf, smollm2_mlx, gemma3_gguf, qwen_coder_gguf):
        f = facts(path)
        d = describe("m", str(path))
        assert (d.format, d.architecture, d.n_params, d.quant, d.context_length, d.chat_template, d.has_fim,
                d.embedding_length) == (f.format, f.architecture, f.n_params, f.quant, f.context_length,
                                        f.chat_template, f.has_fim, f.n_embd)
        shown = show_facts(str(path))
        assert (shown["architecture"], shown["context length"], shown["chat template"]) == (
            f.architecture, f.context_length, f.chat_template)
        assert shown["parameters"].endswith(f"({f.n_params:,})")
        assert ("tools" in shown["capabilities"]) == f.has_tools
        shape = model_shape(path)
        assert (shape.architecture, shape.n_layer, shape.n_ctx_train, shape.n_embd, shape.n_ff, shape.n_vocab,
                shape.kv_heads, shape.head_dim_k, shape.head_dim_v, shape.swa, shape.sliding_window) == (
            f.architecture, f.n_layer, f.context_length, f.n_embd, f.n_ff, f.n_vocab, f.kv_heads, f.head_dim,
            f.head_dim_v, f.swa_layers, f.sliding_window)


# --- GGUF rules, on small written files --------------------------------------------------

def write_gguf(path, arch="llama", n_vocab=100, **keys) -> str:
    """A tiny GGUF with `keys` ({name: value}; an arch-relative name starts with '.')."""
    w = gguf.GGUFWriter(path, arch=arch)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(n_vocab)])
    for name, value in keys.items():
        name = f"{arch}{name}" if name.startswith(".") else name
        if isinstance(value, str):
            w.add_string(name, value)
        elif isinstance(value, list):
            w.add_array(name, value)
        elif isinstance(value, bool):
            w.add_bool(name, value)
        else:
            w.add_uint32(name, value)
    w.add_tensor("token_embd.weight", np.zeros((n_vocab, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return str(path)


def test_llama_cpp_defaults_where_the_file_is_silent(tmp_path):
    f = facts(write_gguf(tmp_path / "m.gguf", **{".block_count": 4, ".embedding_length": 256,
                                                  ".attention.head_count": 8}))
    assert (f.n_head, f.n_head_kv, f.kv_heads, f.head_dim, f.head_dim_v) == (8, 8, (8,) * 4, 32, 32)
    assert (f.n_vocab, f.n_params, f.context_length, f.n_ff, f.quant, f.file_type) == (100, 800, 0, 0, "unknown", None)
    assert f.chat_template is None and not f.has_tools


def test_per_layer_values_and_sliding_window_patterns(tmp_path):
    f = facts(write_gguf(tmp_path / "a.gguf", arch="gemma2", **{
        ".block_count": 4, ".attention.head_count": 8, ".attention.head_count_kv": [4, 2],
        ".feed_forward_length": [64, 128, 96, 32], ".attention.sliding_window": 128}))
    assert f.kv_heads == (4, 2, 2, 2)  # a short array is padded with its last value, as llama.cpp does
    assert f.n_ff == 128 and f.sliding_window == 128
    assert f.swa_layers == (True, False, True, False)  # gemma2's default period of 2
    f = facts(write_gguf(tmp_path / "b.gguf", **{".block_count": 3, ".attention.sliding_window": 64,
                                                 ".attention.sliding_window_pattern": [True, True, False]}))
    assert f.swa_layers == (True, True, False)
    f = facts(write_gguf(tmp_path / "c.gguf", **{".block_count": 3, ".attention.sliding_window": 64,
                                                 ".attention.sliding_window_pattern": 3}))
    assert f.swa_layers == (True, True, False)
    many = list(range(1, 101))  # longer than the 64 a string array keeps: a number array is kept whole
    f = facts(write_gguf(tmp_path / "d.gguf", **{".block_count": 100, ".attention.head_count_kv": many}))
    assert f.kv_heads == tuple(many)


def test_fim_ids_from_either_key_inside_the_vocabulary(tmp_path):
    ids = {"tokenizer.ggml.fim_pre_token_id": 5, "tokenizer.ggml.fim_suf_token_id": 6,
           "tokenizer.ggml.fim_mid_token_id": 7}
    f = facts(write_gguf(tmp_path / "a.gguf", **ids))
    assert (f.fim_prefix_id, f.fim_suffix_id, f.fim_middle_id, f.has_fim) == (5, 6, 7, True)
    legacy = {"tokenizer.ggml.prefix_token_id": 5, "tokenizer.ggml.suffix_token_id": 6,
              "tokenizer.ggml.middle_token_id": 7}
    assert facts(write_gguf(tmp_path / "b.gguf", **legacy)).has_fim
    outside = dict(ids, **{"tokenizer.ggml.fim_mid_token_id": 100})  # the vocabulary has ids 0..99
    f = facts(write_gguf(tmp_path / "c.gguf", **outside))
    assert f.fim_middle_id is None and not f.has_fim


def test_a_tools_template_and_an_embedding_model(tmp_path):
    f = facts(write_gguf(tmp_path / "t.gguf", **{"tokenizer.chat_template": "{% for t in tools %}{{ t }}{% endfor %}",
                                                 ".pooling_type": 1}))
    assert f.has_tools and f.pooling_type == 1
    assert not facts(write_gguf(tmp_path / "u.gguf", **{"tokenizer.chat_template": "{{ toolsmith }}"})).has_tools


def test_an_absurd_layer_count_is_refused_not_allocated(tmp_path):
    with pytest.raises(MalformedModelError, match="at most 512"):
        facts(write_gguf(tmp_path / "m.gguf", **{".block_count": 2**31}))


def test_a_split_model_counts_the_tensors_of_every_part(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "s.gguf", arch="llama", split_max_tensors=1)
    w.add_block_count(2)
    for i, shape in enumerate([(4, 32), (2, 32), (3, 32)]):
        w.add_tensor(f"blk.{i}.w", np.zeros(shape, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert facts(tmp_path / "s-00001-of-00003.gguf").n_params == (4 + 2 + 3) * 32


# --- MLX folders ------------------------------------------------------------------------

def mlx_folder(tmp_path, config: dict, tokenizer_config: dict | None = None, tensors: dict | None = None):
    folder = tmp_path / "mlx"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    header = json.dumps(tensors or {"w": {"dtype": "F16", "shape": [4, 8], "data_offsets": [0, 64]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    return folder


def test_a_quantized_multimodal_mlx_folder(tmp_path):
    config = {"model_type": "gemma3", "quantization": {"bits": 4, "group_size": 64},
              "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 4, "hidden_size": 64,
                              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
                              "sliding_window": 512, "sliding_window_pattern": 2,
                              "max_position_embeddings": 2048, "vocab_size": 300}}
    packed = {"w": {"dtype": "U32", "shape": [4, 8], "data_offsets": [0, 128]},
              "w.scales": {"dtype": "F16", "shape": [4, 1], "data_offsets": [128, 136]}}
    f = facts(mlx_folder(tmp_path, config, {"chat_template": [{"name": "default", "template": "{{ tools }}"},
                                                             {"name": "rag", "template": "x"}]}, packed))
    assert (f.architecture, f.quant, f.n_params) == ("gemma3", "4bit", 4 * 8 * 32 // 4)  # 8 4-bit weights a U32
    assert (f.n_layer, f.n_head_kv, f.head_dim, f.context_length, f.n_vocab) == (4, 1, 32, 2048, 300)
    assert f.swa_layers == (True, False, True, False) and f.sliding_window == 512
    assert f.chat_template == "{{ tools }}" and f.has_tools


def test_mlx_layer_types_and_a_window_no_layer_uses(tmp_path):
    base = {"model_type": "qwen2", "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4}
    f = mlx_config_facts({**base, "sliding_window": 4096, "use_sliding_window": False})
    assert f.sliding_window is None and f.swa_layers == (False,) * 3
    f = mlx_config_facts({**base, "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"]})
    assert f.swa_layers == (True, False, False) and f.sliding_window == 128
    assert (f.head_dim, f.n_head_kv, f.quant) == (16, 4, "F16")


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path):
    folder = mlx_folder(tmp_path, {"model_type": "llama", "num_hidden_layers": 1}, {"chat_template": "old"})
    (folder / "chat_template.jinja").write_text("new {{ messages }}")
    assert facts(folder).chat_template == "new {{ messages }}"


def test_broken_mlx_folders_get_one_line_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UnsupportedFormatError, match="no config.json"):
        facts(empty)
    folder = mlx_folder(tmp_path, {"model_type": "llama"})
    (folder / "config.json").write_text("{not json")
    with pytest.raises(MalformedModelError, match="config.json is not valid JSON"):
        facts(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(MalformedModelError, match="model.safetensors"):
        facts(folder)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_in_an_mlx_folder_does_not_block(tmp_path):
    folder = mlx_folder(tmp_path, {"model_type": "llama"})
    os.mkfifo(folder / "chat_template.jinja")
    outcome: dict = {}
    t = threading.Thread(target=lambda: outcome.update(error=_error_of(facts, folder)), daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():
        with open(folder / "chat_template.jinja", "wb"):
            pass  # opening the write end is what releases the blocked reader
        pytest.fail("facts() blocked on a FIFO")
    assert isinstance(outcome["error"], UnsupportedFormatError)


def _error_of(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test looks at the type
        return exc
    return None


def test_facts_are_frozen(smollm2_gguf):
    f = facts(smollm2_gguf)
    assert isinstance(f, ModelFacts)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.n_layer = 1  # type: ignore[misc]
