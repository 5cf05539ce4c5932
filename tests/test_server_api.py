"""`localrun serve` against real clients: the official `openai` and `ollama` packages,
and raw requests shaped like llama.vim's /infill and Continue's /api/show +
/api/generate. One real server process (SmolLM2, plus Qwen2.5-Coder for fill-in-the-
middle: a real code model whose FIM tokens llama.cpp finds by their text) serves the
whole module."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import pytest

from serving import Server

GREEDY = {"temperature": 0}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(smollm2_gguf, qwen_coder_gguf):
    srv = Server("--model", str(smollm2_gguf), "--model", str(qwen_coder_gguf), "--ctx", "1024", "--parallel", "4")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    openai = pytest.importorskip("openai", reason="the openai client is a test extra")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def olm(server):
    ollama = pytest.importorskip("ollama", reason="the ollama client is a test extra")
    return ollama.Client(host=server.url)


MODEL = "smollm2-135m-instruct-q4_1"
FIM_MODEL = "qwen2.5-coder-0.5b-instruct-q4_k_m"
ASK = [{"role": "user", "content": "Name three colours."}]


# -- OpenAI ----------------------------------------------------------------------


def test_openai_chat_stream_equals_non_stream(oai):
    full = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0)
    assert full.choices[0].message.content
    assert full.usage.completion_tokens == 24 or full.choices[0].finish_reason == "stop"
    chunks = list(oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_openai_stream_ends_with_done_and_usage(server):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][6:])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] <= 8


def test_openai_json_schema(oai):
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Invent a person. Answer in JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_openai_json_object(oai):
    ask = [{"role": "user", "content": 'Reply with exactly this JSON: {"ok": true}'}]
    r = oai.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_openai_logprobs_and_seed(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, logprobs=True, top_logprobs=3, seed=7)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens
    for item in lp:
        assert len(item.top_logprobs) == 3
        assert item.logprob <= 0
        assert item.top_logprobs[0].logprob >= item.logprob - 1e-6  # the best is at least as likely
    again = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, logprobs=True, top_logprobs=3, seed=7)
    assert again.choices[0].message.content == r.choices[0].message.content


def test_openai_completions_with_stop(oai):
    r = oai.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=["7"])
    assert "7" not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    assert "5" in r.choices[0].text


def fim_prompt(server, prefix: str, suffix: str) -> list[int]:
    """Qwen2.5-Coder's fill-in-the-middle prompt: <|fim_prefix|> prefix up to the cursor's
    line <|fim_suffix|> suffix <|fim_middle|> the cursor's line up to the cursor."""

    def tokenize(text: str) -> list[int]:
        r = httpx.post(server.url + "/tokenize", json={"model": FIM_MODEL, "content": text}, timeout=30)
        return r.json()["tokens"] if text else []

    pre, suf, mid = tokenize("<|fim_prefix|>"), tokenize("<|fim_suffix|>"), tokenize("<|fim_middle|>")
    assert len(pre) == len(suf) == len(mid) == 1
    line = prefix.rfind("\n") + 1
    return pre + tokenize(prefix[:line]) + suf + tokenize(suffix) + mid + tokenize(prefix[line:])


def test_openai_completions_suffix_needs_fim(oai, server):
    import openai

    with pytest.raises(openai.BadRequestError, match="fill-in-the-middle"):
        oai.completions.create(model=MODEL, prompt="def f(", suffix="\n", max_tokens=4)
    # the function's name is only in the suffix: the middle can write it only if it read the suffix
    prefix, suffix = "def ", "(a, b):\n    return a * b\n\n\nprint(multiply(2, 3))\n"
    r = oai.completions.create(model=FIM_MODEL, prompt=prefix, suffix=suffix, max_tokens=4, temperature=0)
    read = len(fim_prompt(server, prefix, suffix))
    assert read - 3 <= r.usage.prompt_tokens < read  # token healing took the space after "def" off the prompt
    assert r.choices[0].text.startswith("multiply"), r.choices[0].text  # and the answer does not repeat it


def test_openai_models_lists_configured(oai):
    ids = {m.id for m in oai.models.list().data}
    assert {MODEL, FIM_MODEL} <= ids


def test_openai_error_shape(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": "hi"}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert "messages" in err["message"] and err["type"] == "invalid_request_error"


def test_openai_embeddings(oai):
    r = oai.embeddings.create(model=MODEL, input=["the cat sat", "the cat sat", "quantum chromodynamics"])
    a, b, c = (d.embedding for d in r.data)
    assert len(a) == 576 and a == b
    dot = lambda x, y: sum(p * q for p, q in zip(x, y))  # noqa: E731
    assert abs(dot(a, a) - 1) < 1e-3  # normalised
    assert dot(a, c) < 0.999


# -- Ollama ----------------------------------------------------------------------


def test_ollama_chat_stream(olm):
    parts = list(olm.chat(model=MODEL, messages=ASK, stream=True, options={"num_predict": 16, **GREEDY}))
    assert parts[-1].done and parts[-1].eval_count <= 16 and parts[-1].prompt_eval_count > 0
    assert parts[-1].eval_duration > 0
    one = olm.generate(model=MODEL, prompt="Hello", options={"num_predict": 1, **GREEDY})
    assert one.eval_count == 1 and one.eval_duration > 0  # clients divide by it
    streamed = "".join(p.message.content for p in parts)
    whole = olm.chat(model=MODEL, messages=ASK, stream=False, options={"num_predict": 16, **GREEDY})
    assert whole.message.content == streamed


def test_ollama_generate_format_schema(olm):
    r = olm.generate(model=MODEL, prompt="Invent a person.", format=SCHEMA, options={"num_predict": 60, **GREEDY})
    jsonschema.validate(json.loads(r.response), SCHEMA)
    assert r.context and r.done_reason in ("stop", "length")


def test_ollama_generate_raw(olm):
    r = olm.generate(model=MODEL, prompt="The capital of France is", raw=True, options={"num_predict": 4, **GREEDY})
    assert "Paris" in r.response


def test_ollama_show_tags_ps_version(olm, server):
    shown = olm.show(FIM_MODEL)
    assert "insert" in shown.capabilities and "completion" in shown.capabilities
    assert shown.modelinfo["qwen2.context_length"] == 1024  # the served context
    assert "insert" not in olm.show(MODEL).capabilities
    names = {m.model for m in olm.list().models}
    assert {MODEL, FIM_MODEL} <= names
    olm.generate(model=MODEL, prompt="hi", options={"num_predict": 1})
    assert MODEL in {m.model for m in olm.ps().models}
    assert httpx.get(server.url + "/api/version").json()["version"]


def test_ollama_embed(olm):
    r = olm.embed(model=MODEL, input=["hello", "world"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == 576


def test_ollama_unknown_model_is_404(olm):
    import ollama

    with pytest.raises(ollama.ResponseError) as info:
        olm.chat(model="no-such-model", messages=ASK)
    assert info.value.status_code == 404


def test_continue_show_then_generate_with_suffix(server):
    """Continue's autocomplete: /api/show for the context length, then /api/generate with suffix."""
    show = httpx.post(server.url + "/api/show", json={"name": FIM_MODEL}, timeout=30).json()
    assert show["model_info"]["qwen2.context_length"] > 0
    prefix, suffix = "class ", ":\n    pass\n\n\nshape = Rectangle()\n"  # the name is only after the cursor
    body = {"model": FIM_MODEL, "prompt": prefix, "suffix": suffix,
            "stream": False, "raw": True, "options": {"temperature": 0.01, "num_predict": 8, "stop": ["\n\n"]},
            "keep_alive": 1800}
    r = httpx.post(server.url + "/api/generate", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["done"]
    prompt, read = fim_prompt(server, prefix, suffix), r.json()["prompt_eval_count"]
    # token healing took the cursor's last token ("class" " ": the space) off the prompt,
    # and the answer wrote it again (" Rectangle"), which its text does not repeat
    assert len(prompt) - 3 <= read < len(prompt) and r.json()["context"][:read] == prompt[:read]
    assert len(r.json()["context"]) == read + r.json()["eval_count"]  # the prompt read, then the answer
    assert r.json()["response"].startswith("Rectangle"), r.json()["response"]
    bad = httpx.post(server.url + "/api/generate", json={**body, "model": MODEL}, timeout=60)
    assert bad.status_code == 400 and "fill-in-the-middle" in bad.json()["error"]


# -- llama-server ----------------------------------------------------------------


def llama_vim_body(prefix: str, suffix: str) -> dict:
    """What llama.vim sends for a completion at the cursor."""
    return {
        "input_prefix": prefix, "input_suffix": suffix,
        "input_extra": [{"filename": "util.py", "text": "def helper():\n    return 1\n"}],
        "prompt": "    ", "n_predict": 16, "n_indent": 4, "top_k": 40, "top_p": 0.99, "stream": False,
        "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
        "t_max_predict_ms": 1000, "response_fields": ["content", "timings/prompt_n", "tokens_cached"],
    }


def test_llama_vim_infill_and_prefix_cache(server):
    prefix = "import os\n\n" + "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(40)) + "def main():\n"
    body = {**llama_vim_body(prefix, "\n\nif __name__ == '__main__':\n    main()\n"), "model": FIM_MODEL}
    # llama.vim's warm-up: n_predict 0 reads the context into a slot and answers nothing
    warm = httpx.post(server.url + "/infill", json={**body, "n_predict": 0, "samplers": []}, timeout=60)
    assert warm.status_code == 200, warm.text
    assert warm.json()["content"] == "" and warm.json()["timings/prompt_n"] > 100
    first = httpx.post(server.url + "/infill", json=body, timeout=60).json()
    # response_fields: only what llama.vim asked for, nested ones flattened
    assert set(first) <= {"content", "timings/prompt_n", "tokens_cached"}
    assert first["timings/prompt_n"] < 10 and first["tokens_cached"] > 100
    # the same file again (the editor moved on a line): the shared prefix comes from the slot's KV
    again = httpx.post(server.url + "/infill", json={**body, "prompt": "    x"}, timeout=60).json()
    assert again["tokens_cached"] > 100 and again["timings/prompt_n"] < 10


def test_infill_in_the_whole_prefix_shape_heals_the_cut_token_and_rereads_only_the_typing(server):
    """Continue's shape: the whole text before the cursor in input_prefix, the cursor after
    "def ". The answer does not repeat the space the prompt ended on (token healing), and
    typing on re-reads what was typed, not the suffix after it."""
    prefix = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(30)) + "def "
    suffix = "(a, b):\n    return a * b\n\n" + "".join(f"def g{i}(x):\n    return x - {i}\n\n" for i in range(10))
    body = {"model": FIM_MODEL, "input_prefix": prefix, "input_suffix": suffix, "n_predict": 4, "temperature": 0}
    first = httpx.post(server.url + "/infill", json=body, timeout=60).json()
    assert first["content"] and not first["content"].startswith(" "), first["content"]
    typed = httpx.post(server.url + "/infill", json={**body, "input_prefix": prefix + "mul"}, timeout=60).json()
    assert typed["timings"]["cache_n"] > 300 and typed["timings"]["prompt_n"] <= 4, typed["timings"]


def test_infill_without_fim_tokens_is_400(server):
    r = httpx.post(server.url + "/infill", json=llama_vim_body("a", "b"), timeout=30)  # default model: no FIM
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]


def test_completion_stream_and_probs(server):
    body = {"prompt": "The capital of France is", "n_predict": 6, "temperature": 0, "n_probs": 2}
    whole = httpx.post(server.url + "/completion", json=body, timeout=60).json()
    assert whole["stop"] and whole["tokens_predicted"] == 6 and whole["stop_type"] == "limit"
    assert len(whole["completion_probabilities"]) == 6
    with httpx.stream("POST", server.url + "/completion", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["stop"] and events[-1]["timings"]["predicted_n"] == 6


def test_logit_bias_by_text_and_by_id(server):
    body = {"prompt": "The capital of France is", "n_predict": 6, "temperature": 0, "lookup": False}
    free = httpx.post(server.url + "/completion", json=body, timeout=60).json()
    assert "Paris" in free["content"]
    for bias in ([[" Paris", False]], {" Paris": -100}):  # llama-server's list form, OpenAI's object form
        r = httpx.post(server.url + "/completion", json={**body, "logit_bias": bias}, timeout=60)
        assert r.status_code == 200 and "Paris" not in r.json()["content"], (bias, r.text)
    bad = httpx.post(server.url + "/completion", json={**body, "logit_bias": [["", 1]]}, timeout=30)
    assert bad.status_code == 400 and "logit_bias" in bad.json()["error"]["message"]


def test_tokenize_detokenize_round_trip(server):
    text = "Hello, world! Ünïcödé"
    toks = httpx.post(server.url + "/tokenize", json={"content": text}, timeout=30).json()["tokens"]
    assert toks and all(isinstance(t, int) for t in toks)
    back = httpx.post(server.url + "/detokenize", json={"tokens": toks}, timeout=30).json()["content"]
    assert back == text
    pieces = httpx.post(server.url + "/tokenize", json={"content": "Hi", "with_pieces": True}, timeout=30).json()
    assert "".join(p["piece"] for p in pieces["tokens"]) == "Hi"


def test_health_props_slots_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    props = httpx.get(server.url + "/props", timeout=30).json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 1024
    slots = httpx.get(server.url + "/slots").json()
    assert len([s for s in slots if s["model"] == MODEL]) == 4
    httpx.post(server.url + "/completion", json={"prompt": "Hi", "n_predict": 3}, timeout=60)
    text = httpx.get(server.url + "/metrics").text
    assert "# TYPE llamacpp:tokens_predicted_total counter" in text
    line = next(x for x in text.splitlines() if x.startswith(f'llamacpp:tokens_predicted_total{{model="{MODEL}"}}'))
    assert float(line.split()[-1]) >= 3


def test_indent_limit_cuts_at_the_first_under_indented_line():
    from localrun.server.indent import IndentLimit

    limit = IndentLimit(4)
    assert limit.cut("x = 1") is None  # the first line continues the cursor's line: never cut
    assert limit.cut("\n    y = 2\n\n  ") is None  # enough indentation; a blank line is no content
    assert limit.cut("\t") is None  # tabs count one each: 3 so far
    assert limit.cut("z") == 0  # content at indentation 3 < 4
    whole = IndentLimit(2)
    text = "a\n  b\n   c\n d\ne"
    assert whole.cut(text) == text.index(" d") + 1


def cut_where_indent_drops(text: str, n_indent: int) -> str:
    """The test's own reading of n_indent: drop everything from the first non-blank
    character of a later line indented less than n_indent."""
    at = 0
    for i, line in enumerate(text.split("\n")):
        content = line.lstrip(" \t")
        if i and content and len(line) - len(content) < n_indent:
            return text[: at + len(line) - len(content)]
        at += len(line) + 1
    return text


def test_n_indent_ends_a_completion_that_leaves_the_block(server):
    body = {"prompt": "def add(a, b):\n    return a + b\n\n\ndef", "n_predict": 40, "temperature": 0,
            "ignore_eos": True, "lookup": False}
    full = httpx.post(server.url + "/completion", json=body, timeout=60).json()
    # here the free answer writes a function body (kept at n_indent 4), then another "def"
    # (cut); should another CPU's greedy answer stay in the block, a deeper n_indent cuts
    # any later line
    n_indent = 4 if cut_where_indent_drops(full["content"], 4) != full["content"] else 100
    expected = cut_where_indent_drops(full["content"], n_indent)
    assert expected != full["content"], full["content"]
    limited = httpx.post(server.url + "/completion", json={**body, "n_indent": n_indent}, timeout=60).json()
    assert limited["content"] == expected
    assert limited["stop_type"] == "limit" and limited["tokens_predicted"] < 40
    stream_body = {**body, "n_indent": n_indent, "stream": True}
    with httpx.stream("POST", server.url + "/completion", json=stream_body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == expected and events[-1]["stop_type"] == "limit"
    bad = httpx.post(server.url + "/completion", json={**body, "n_indent": -1}, timeout=30)
    assert bad.status_code == 400 and "n_indent" in bad.json()["error"]["message"]


def test_t_max_predict_ms_ends_a_long_completion(server):
    # the budget applies once the answer has a newline: greedy on a numbered list has one
    # within a few tokens (sampled, an answer could run 900 tokens without one)
    body = {"prompt": "Count, one number a line:\n1\n2\n3\n", "n_predict": 900, "ignore_eos": True,
            "t_max_predict_ms": 300, "lookup": False, "temperature": 0}
    r = httpx.post(server.url + "/completion", json=body, timeout=120).json()
    assert r["stop_type"] == "limit" and 1 <= r["tokens_predicted"] < 900


def test_keep_alive_zero_unloads_and_negative_keeps(olm, server):
    olm.generate(model=FIM_MODEL, prompt="x", options={"num_predict": 1}, keep_alive=-1)
    ps = {m.model: m for m in olm.ps().models}
    assert ps[FIM_MODEL].expires_at.year == 9999  # kept until told otherwise
    r = httpx.post(server.url + "/api/generate", json={"model": FIM_MODEL, "keep_alive": 0}, timeout=30).json()
    assert r["done_reason"] == "unload"
    assert FIM_MODEL not in {m.model for m in olm.ps().models}
    # a model unloads by itself once idle for its keep_alive
    olm.generate(model=FIM_MODEL, prompt="x", options={"num_predict": 1}, keep_alive="1s")
    assert FIM_MODEL in {m.model for m in olm.ps().models}
    deadline = time.monotonic() + 10
    while FIM_MODEL in {m.model for m in olm.ps().models}:
        assert time.monotonic() < deadline, "not unloaded 10 s after a 1 s keep_alive"
        time.sleep(0.2)


def test_completion_reports_the_stop_word(server):
    body = {"prompt": "1, 2, 3, 4,", "n_predict": 20, "temperature": 0, "stop": [" 6"]}
    r = httpx.post(server.url + "/completion", json=body, timeout=60).json()
    assert r["stop_type"] == "word" and r["stopping_word"] == " 6" and "6" not in r["content"]


# -- request bounds: a 400 naming the field, before any work (localrun.request) ------------


OVER_THE_BOUNDS = [
    ("/completion", {"prompt": "hi", "logit_bias": [[99999999999999999999, 1]]}, "logit_bias"),
    ("/completion", {"prompt": "hi", "logit_bias": [[49152, 1]]}, "logit_bias"),  # SmolLM2 has ids 0..49151
    ("/completion", {"prompt": "hi", "stop": ["x"] * 17}, "stop"),
    ("/completion", {"prompt": "hi", "n_probs": 21}, "n_probs"),
    ("/completion", {"prompt": "hi", "n_indent": 5000}, "n_indent"),
    ("/completion", {"prompt": "hi", "response_fields": ["content"] * 65}, "response_fields"),
    ("/completion", {"prompt": "hi", "grammar": "root ::= " + '"a" ' * 70000}, "grammar"),
    ("/infill", {"input_prefix": "a", "input_extra": [{"text": "x"}] * 257}, "input_extra"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 8193}, "messages"),
    ("/v1/completions", {"prompt": [1] * (1 << 20 | 1)}, "prompt"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "options": {"stop": ["x" * 257]}},
     "options.stop[0]"),
]


@pytest.mark.parametrize("path, body, field", OVER_THE_BOUNDS, ids=[f"{p} {f}" for p, _, f in OVER_THE_BOUNDS])
def test_a_field_over_its_bound_is_a_400_naming_it(server, path, body, field):
    r = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in (err if isinstance(err, str) else err["message"])
    ok = httpx.post(server.url + "/completion", json={"prompt": "1, 2, 3,", "n_predict": 2}, timeout=60)
    assert ok.status_code == 200  # and the model's scheduler still serves
