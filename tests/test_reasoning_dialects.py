"""Every dialect renders a thinking model's reasoning apart from its answer, and reads its
reasoning controls and earlier turns' thinking into the template (issue 50, items 1-2).

The server here is the real app, model manager, scheduler and engine, in process, over
the scripted thinking model of tests/thinking_fakes.py ("<think>plan</think>answer"
after a template that reads enable_thinking, reasoning_effort and reasoning_content);
what comes back is read by the official clients: the `openai` and `anthropic` SDKs (over
the in-process transport) and the `ollama` SDK's response types."""

from __future__ import annotations

import json

import anthropic
import ollama
import openai
import pytest
from starlette.testclient import TestClient

from localrun.engine import Engine
from localrun.server.app import build_app
from localrun.server.models import ModelManager
from localrun.server.reasoning import Reasoning
from thinking_fakes import ANSWER, EMPTY_THINKING, PLAN, thinking_engine

MODEL = "thinker"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(autouse=True)
def empty_store(tmp_path, monkeypatch):
    """Empty store, HF cache and LM Studio folders: never the user's models."""
    for var, name in (("LOCALRUN_MODELS", "store"), ("HF_HUB_CACHE", "hf"), ("LOCALRUN_LMSTUDIO_MODELS", "lms")):
        (tmp_path / name).mkdir()
        monkeypatch.setenv(var, str(tmp_path / name))


@pytest.fixture
def engines(monkeypatch) -> list:
    """Engine.open replaced by the scripted thinking model; the engines it made."""
    made = []

    def fake_open(path, *args, **options):
        made.append(thinking_engine())
        return made[-1]

    monkeypatch.setattr(Engine, "open", fake_open)
    return made


def serve(tmp_path, reasoning: Reasoning | None = None) -> TestClient:
    model = tmp_path / f"{MODEL}.gguf"
    model.write_bytes(b"GGUF" + bytes(60))  # the magic is all the path policy reads
    manager = ModelManager([str(model)], n_ctx=2048, parallel=2, threads=1, max_queue=4)
    return TestClient(build_app(manager, reasoning=reasoning), base_url="http://127.0.0.1")


@pytest.fixture
def http(tmp_path, engines):
    with serve(tmp_path) as client:
        yield client


def last_request(engines):
    return engines[-1].requests[-1]


# -- OpenAI chat ---------------------------------------------------------------------------


def test_openai_chat_reasoning_content_whole_and_streamed(http):
    client = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="x", http_client=http)
    whole = client.chat.completions.create(model=MODEL, messages=HI)
    msg = whole.choices[0].message
    assert (msg.content, msg.reasoning_content) == (ANSWER, PLAN)
    assert whole.usage.completion_tokens_details.reasoning_tokens == len(PLAN)  # one byte a token
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == PLAN
    assert "".join(d.content or "" for d in deltas) == ANSWER
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == len(PLAN)


@pytest.mark.parametrize("fields, thinking", [
    ({"reasoning_effort": "none"}, ""),
    ({"reasoning_effort": "low"}, "plan-low"),
    ({"reasoning_effort": "minimal"}, "plan-low"),
    ({"reasoning_effort": "xhigh"}, "plan-high"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, ""),
    ({"chat_template_kwargs": {"reasoning_effort": "medium"}}, "plan-medium"),
    # a request's own template variables win over what its effort level implies
    ({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}, ""),
])
def test_openai_controls_reach_the_template(http, fields, thinking):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, **fields})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == ANSWER and msg.get("reasoning_content", "") == thinking


def test_openai_format_none_budget_and_history(http, engines):
    raw = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "reasoning_format": "none"}).json()
    assert raw["choices"][0]["message"] == {"role": "assistant", "content": f"<think>{PLAN}</think>{ANSWER}"}
    for key in ("thinking_budget_tokens", "reasoning_budget"):
        assert http.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, key: 5}).status_code == 200
        assert last_request(engines).reasoning_budget == 5
    history = [*HI, {"role": "assistant", "content": ANSWER, "reasoning_content": "old"},
               {"role": "user", "content": "again"}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": history}).json()
    assert r["choices"][0]["message"]["content"] == f"{ANSWER} (after old)"  # the template showed it


def test_openai_completions_stay_raw(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "<|im_start|>assistant\n", "max_tokens": 40})
    assert r.json()["choices"][0]["text"] == f"<think>{PLAN}</think>{ANSWER}"


# -- Ollama --------------------------------------------------------------------------------


def test_ollama_chat_thinking_whole_and_streamed(http):
    whole = ollama.ChatResponse.model_validate(http.post("/api/chat", json={
        "model": MODEL, "messages": HI, "stream": False}).json())
    assert (whole.message.content, whole.message.thinking) == (ANSWER, PLAN)
    lines = [json.loads(line) for line in http.post("/api/chat", json={"model": MODEL, "messages": HI}).text.splitlines()]
    parts = [ollama.ChatResponse.model_validate(x).message for x in lines]
    assert "".join(p.thinking or "" for p in parts) == PLAN
    assert "".join(p.content or "" for p in parts) == ANSWER
    assert not any(p.thinking and p.content for p in parts)  # thinking comes in chunks of its own


@pytest.mark.parametrize("think, thinking", [(True, PLAN), (False, ""), ("low", "plan-low"), ("high", "plan-high")])
def test_ollama_think_reaches_the_template(http, think, thinking):
    r = http.post("/api/chat", json={"model": MODEL, "messages": HI, "stream": False, "think": think}).json()
    assert r["message"]["content"] == ANSWER and r["message"].get("thinking", "") == thinking


def test_ollama_generate_history_and_raw(http):
    gen = ollama.GenerateResponse.model_validate(http.post("/api/generate", json={
        "model": MODEL, "prompt": "hi", "stream": False, "think": "medium"}).json())
    assert (gen.response, gen.thinking) == (ANSWER, "plan-medium")
    raw = http.post("/api/generate", json={"model": MODEL, "prompt": "<|im_start|>assistant\n", "raw": True,
                                           "stream": False, "options": {"num_predict": 40}}).json()
    assert raw["response"] == f"<think>{PLAN}</think>{ANSWER}" and "thinking" not in raw
    history = [*HI, {"role": "assistant", "content": ANSWER, "thinking": "older"}, {"role": "user", "content": "more"}]
    r = http.post("/api/chat", json={"model": MODEL, "messages": history, "stream": False}).json()
    assert r["message"]["content"] == f"{ANSWER} (after older)"


# -- Anthropic -----------------------------------------------------------------------------


def test_anthropic_thinking_blocks_whole_and_streamed(http):
    client = anthropic.Anthropic(base_url="http://127.0.0.1", api_key="x", http_client=http)
    whole = client.messages.create(model=MODEL, max_tokens=64, messages=HI)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == PLAN and whole.content[0].signature and whole.content[1].text == ANSWER
    with client.messages.stream(model=MODEL, max_tokens=64, messages=HI) as stream:
        kinds = [(ev.type, getattr(getattr(ev, "delta", None), "type", None)) for ev in stream]
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert kinds.index(("content_block_delta", "thinking_delta")) < kinds.index(("content_block_delta", "signature_delta"))
    assert kinds.index(("content_block_delta", "signature_delta")) < kinds.index(("content_block_delta", "text_delta"))


def test_anthropic_thinking_controls_and_history(http, engines):
    off = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 64, "messages": HI,
                                          "thinking": {"type": "disabled"}}).json()
    assert off["content"] == [{"type": "text", "text": ANSWER}]
    on = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 64, "messages": HI,
                                         "thinking": {"type": "enabled", "budget_tokens": 1024},
                                         "output_config": {"effort": "low"}}).json()
    assert on["content"][0]["thinking"] == "plan-low" and last_request(engines).reasoning_budget == 1024
    history = [*HI, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "before", "signature": "whatever a client kept"},
        {"type": "redacted_thinking", "data": "sealed"},
        {"type": "text", "text": ANSWER}]}, {"role": "user", "content": "next"}]
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 64, "messages": history}).json()
    assert r["content"][-1]["text"] == f"{ANSWER} (after before)"
    counted = http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": HI,
                                                          "thinking": {"type": "disabled"}}).json()
    plain = http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": HI}).json()
    assert counted["input_tokens"] == plain["input_tokens"] + len(EMPTY_THINKING)  # the template saw it


def test_anthropic_omitted_thinking_rides_in_the_signature_and_comes_back(http):
    """thinking.display "omitted": empty thinking blocks, no thinking_delta, and the
    signature carries the text, so the block handed back gives the template its thinking."""
    client = anthropic.Anthropic(base_url="http://127.0.0.1", api_key="x", http_client=http)
    ask = dict(model=MODEL, max_tokens=64, messages=HI,
               thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"})
    whole = client.messages.create(**ask)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    block = whole.content[0]
    assert block.thinking == "" and PLAN not in block.signature and whole.content[1].text == ANSWER
    with client.messages.stream(**ask) as stream:
        kinds = [(ev.type, getattr(getattr(ev, "delta", None), "type", None)) for ev in stream]
        final = stream.get_final_message()
    assert ("content_block_delta", "thinking_delta") not in kinds
    assert ("content_block_delta", "signature_delta") in kinds
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]

    history = [*HI, {"role": "assistant", "content": [block.model_dump(), {"type": "text", "text": ANSWER}]},
               {"role": "user", "content": "next"}]
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 64, "messages": history}).json()
    assert r["content"][-1]["text"] == f"{ANSWER} (after {PLAN})"
    damaged = [*HI, {"role": "assistant", "content": [{"type": "thinking", "thinking": "",
                                                        "signature": "localrun-thinking.%%not base64"},
                                                       {"type": "text", "text": ANSWER}]},
               {"role": "user", "content": "next"}]
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 64, "messages": damaged})
    assert r.status_code == 200 and r.json()["content"][-1]["text"] == ANSWER  # no thinking to restore
    shown = http.post("/v1/messages", json={**ask, "thinking": {"type": "adaptive", "display": "summarized"}}).json()
    assert shown["content"][0]["thinking"] == PLAN
    bad = http.post("/v1/messages", json={**ask, "thinking": {"type": "adaptive", "display": "full"}})
    assert bad.status_code == 400 and "'thinking.display'" in bad.json()["error"]["message"]


# -- Responses -----------------------------------------------------------------------------


def test_responses_reasoning_item_whole_and_streamed(http):
    client = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="x", http_client=http)
    whole = client.responses.create(model=MODEL, input="hi")
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    item = whole.output[0]
    assert [c.text for c in item.content] == [PLAN] and item.summary == []
    assert whole.output_text == ANSWER and whole.usage.output_tokens_details.reasoning_tokens == len(PLAN)
    with client.responses.stream(model=MODEL, input="hi") as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == PLAN
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [PLAN]
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == ANSWER
    assert final.output[0].content[0].text == PLAN


def test_responses_effort_and_reasoning_items_in_the_input(http):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "reasoning": {"effort": "low"}}).json()
    assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": "plan-low"}]
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "reasoning": {"effort": "none"}}).json()
    assert [i["type"] for i in r["output"]] == ["message"]
    given = [{"role": "user", "content": "hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "thought"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ANSWER}]},
             {"role": "user", "content": "again"}]
    r = http.post("/v1/responses", json={"model": MODEL, "input": given}).json()
    assert r["output_text"] == f"{ANSWER} (after thought)"
    # an OpenAI model's sealed reasoning has no text for this one: dropped, as before
    sealed = [given[0], {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "gAAAA"}, *given[2:]]
    assert http.post("/v1/responses", json={"model": MODEL, "input": sealed}).json()["output_text"] == ANSWER


# -- llama-server's raw routes and the server's defaults -----------------------------------


def test_llama_completion_stays_raw(http):
    r = http.post("/completion", json={"prompt": "<|im_start|>assistant\n", "n_predict": 40}).json()
    assert r["content"] == f"<think>{PLAN}</think>{ANSWER}"


def test_server_defaults_apply_unless_a_request_says_otherwise(tmp_path, engines):
    with serve(tmp_path, Reasoning(budget=7, format="none")) as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HI}).json()
        assert r["choices"][0]["message"]["content"] == f"<think>{PLAN}</think>{ANSWER}"
        assert last_request(engines).reasoning_budget == 7
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "reasoning_format": "auto",
                                                    "reasoning_budget": -1}).json()
        assert r["choices"][0]["message"]["reasoning_content"] == PLAN
        assert last_request(engines).reasoning_budget is None  # -1: no limit, over the server's 7
        http.post("/api/chat", json={"model": MODEL, "messages": HI, "stream": False})
        assert last_request(engines).reasoning_budget == 7
