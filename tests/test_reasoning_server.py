"""The reasoning controls against a real `localrun serve` on SmolLM2 (issue 50, item 7):
every new request field, in every dialect, is bounded and a wrong one is a 400 of one
line naming the field, before any model loads; right ones pass through a template that
reads none of them (SmolLM2's) without changing what it does."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from localrun.request import MAX_TEMPLATE_KWARGS_BYTES
from serving import Server
from test_server_attacks import stream_victim

CHAT, MESSAGES, RESPONSES, OLLAMA = "/v1/chat/completions", "/v1/messages", "/v1/responses", "/api/chat"
HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    srv = Server("--model", str(smollm2_gguf), "--ctx", "512")
    yield srv
    srv.stop()


DEEP = "@deep@"  # stands for JSON nested 5,000 lists deep (more than json.dumps here can write)
DEEP_JSON = "[" * 5000 + "1" + "]" * 5000


# (route, body fields, the field the error must name)
HOSTILE = [
    (CHAT, {"reasoning_effort": 5}, "reasoning_effort"),
    (CHAT, {"reasoning_effort": "extreme"}, "reasoning_effort"),
    (CHAT, {"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs"),
    (CHAT, {"chat_template_kwargs": {"pad": "x" * (MAX_TEMPLATE_KWARGS_BYTES + 1)}}, "chat_template_kwargs"),
    (CHAT, {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    (CHAT, {"chat_template_kwargs": {"a": DEEP}}, "nests too deeply"),  # the body reader's bound
    (CHAT, {"reasoning_format": "deepseek-legacy"}, "reasoning_format"),
    (CHAT, {"reasoning_format": ["auto"]}, "reasoning_format"),
    (CHAT, {"thinking_budget_tokens": -5}, "thinking_budget_tokens"),
    (CHAT, {"reasoning_budget": 2**40}, "reasoning_budget"),
    (CHAT, {"reasoning_budget": "100"}, "reasoning_budget"),
    (CHAT, {"reasoning_budget": True}, "reasoning_budget"),
    (CHAT, {"messages": [*HI, {"role": "assistant", "content": "", "reasoning_content": {"x": 1}}]}, "reasoning_content"),
    (OLLAMA, {"think": "max"}, "think"),
    (OLLAMA, {"think": 1}, "think"),
    (OLLAMA, {"messages": [*HI, {"role": "assistant", "content": "", "thinking": ["a"]}]}, "thinking"),
    (MESSAGES, {"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    (MESSAGES, {"thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking.budget_tokens"),
    (MESSAGES, {"thinking": {"type": "sometimes"}}, "thinking.type"),
    (MESSAGES, {"thinking": "on"}, "thinking"),
    (MESSAGES, {"messages": [*HI, {"role": "assistant", "content": [{"type": "thinking", "thinking": 7}]}]}, "thinking"),
    (RESPONSES, {"reasoning": {"effort": "max"}}, "reasoning.effort"),
    (RESPONSES, {"reasoning": "low"}, "reasoning"),
    (RESPONSES, {"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "input_text", "text": "x"}]},
                           *HI]}, "content[0]"),
]


def body(route: str, fields: dict) -> dict:
    base = {"model": "smollm2-135m-instruct-q4_1", "messages": HI, "max_tokens": 8, "stream": False}
    if route == RESPONSES:
        base = {"model": base["model"], "input": HI, "max_output_tokens": 8}
    elif route == OLLAMA:
        base["options"] = {"num_predict": 8}
    return {**base, **fields}


def encoded(route: str, fields: dict) -> bytes:
    return json.dumps(body(route, fields)).replace(json.dumps(DEEP), DEEP_JSON).encode()


def message_of(resp: httpx.Response) -> str:
    error = resp.json()["error"]
    return error if isinstance(error, str) else error["message"]


def test_every_reasoning_field_is_bounded_with_a_one_line_400(server):
    """Every hostile field is refused while another client streams, whose greedy answer
    stays the one it gets alone."""
    alone: dict = {}
    stream_victim(server.url, alone, threading.Event())
    out: dict = {}
    started = threading.Event()
    victim = threading.Thread(target=stream_victim, args=(server.url, out, started))
    victim.start()
    assert started.wait(60), "the victim never started streaming"
    refused = []
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for route, fields, field in HOSTILE:
                r = http.post(route, content=encoded(route, fields), headers={"content-type": "application/json"})
                refused.append((route, field, r.status_code, message_of(r) if r.status_code >= 400 else r.text[:200]))
    finally:
        victim.join(120)
    assert "error" not in out and out["text"] == alone["text"], "the victim's answer changed"
    with httpx.Client(base_url=server.url, timeout=30) as http:  # after the victim: its steps stay its own
        answers = {route: http.post(route, json=body(route, {})) for route in (CHAT, OLLAMA, MESSAGES, RESPONSES)}
    for route, field, status, message in refused:
        assert status == 400, (route, field, status, message)
        assert field in message and "\n" not in message, (route, field, message)
    assert {route: r.status_code for route, r in answers.items()} == dict.fromkeys(answers, 200)


def test_controls_pass_through_a_template_that_reads_none_of_them(server):
    """SmolLM2's template reads neither enable_thinking nor reasoning_effort: the prompt,
    and so the greedy answer, are the same with them as without."""
    greedy = {"temperature": 0, "seed": 1, "max_tokens": 12}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        plain = http.post(CHAT, json=body(CHAT, greedy)).json()["choices"][0]["message"]
        for controls in ({"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": False}},
                         {"reasoning_effort": "high", "thinking_budget_tokens": 16}):
            r = http.post(CHAT, json=body(CHAT, {**greedy, **controls}))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"] == plain, controls
        assert "reasoning_content" not in plain and plain["content"]
