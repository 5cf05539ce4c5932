"""Speculative decoding with a draft model on real models (issue 53): a real pair
(Qwen2.5-Coder-1.5B drafted for by its 0.5B), a model drafting for itself on llama.cpp and
MLX, and a server whose concurrent streams draft. The scripted pair, slots, grammar,
pairing errors and pricing are in test_draft_model.py, whose module docstring says how
prices are forced to pay and which batch-drift settings keep rows identical here."""

from __future__ import annotations

import dataclasses

import threading

from localrun.backends.attention import FLASH_ATTN_ENV
from localrun.engine import Engine
from localrun.sampling import SamplingParams
from localrun.speculation.draft_model import MIN_GAIN, DraftModel, DraftModelProposer
from localrun.speculation.proposer import ALONE
from test_draft_model import (  # noqa: F401 - own_cache_dir is an autouse fixture
    EXACT_GREEDY, NO_LOOKUP, alone, chat, force_paying_prices, own_cache_dir, paying_ratios,
)
from test_speculative import GREEDY

# -- 5. a real pair: Qwen2.5-Coder 1.5B with 0.5B; 0.5B with itself ---------------------------


def test_real_pair_declines_at_measured_prices_and_keeps_the_targets_tokens(qwen_coder_15b_gguf, qwen_coder_gguf,
                                                                         monkeypatch):
    """Qwen2.5-Coder-1.5B with its 0.5B as draft model, temperature 0.

    At the prices measured at load (a 2-row step ~1.4-2.1 one-row steps here, a draft step
    ~0.5), a first draft token cannot pay: the draft model must not draft, nor even read the
    prompt. Whether it declines follows those measured prices, which the test reads at
    each step: it asserts the decision matches them, not that this machine's timings
    always come out the same (they usually decline; where they all did, nothing was
    decoded by the draft model at all).

    At prices forced to pay it drafts and keeps most drafts; under the exact_greedy guard
    every answer is the target's own token for token; without the guard at least one is
    (its wide rows drift by up to ~0.2 logits here, which may flip a near tie)."""
    monkeypatch.setenv(FLASH_ATTN_ENV, "off")  # not timed in this test's fresh cache folder (13 s for the 1.5B)
    with Engine.open(qwen_coder_15b_gguf, n_ctx=512, draft=qwen_coder_gguf) as engine:
        model, cost = engine.draft_model, engine.speculator.step_cost
        assert model is not None and model._step_ms is not None and cost.one_row_ms() is not None  # measured
        prompts = [chat(engine, "Write a Python function that adds two numbers."),
                   chat(engine, "List the days of the week.")]
        seen = []  # (a first token's gain at the prices of the moment, the draft) at each step
        real_draft = DraftModelProposer.draft

        def watched(self, history, room, share=ALONE):
            price = self.cost.ratios(2, 0.25)[2] + self.model.step_delta(self.cost)
            odds = self.model.calibration.first_odds(self.greedy)
            out = real_draft(self, history, room, share)
            seen.append(((1 + odds) / price, out))
            return out

        decodes = []
        real_decode = model.backend.decode
        model.backend.decode = lambda batch: (decodes.append(batch), real_decode(batch))[1]
        DraftModelProposer.draft = watched
        try:
            measured = engine.complete(prompts[0], sampling=GREEDY, max_tokens=24, lookup=EXACT_GREEDY)
        finally:
            DraftModelProposer.draft = real_draft
            model.backend.decode = real_decode
        assert seen
        for gain, out in seen:
            assert out == [] or gain >= MIN_GAIN  # never a draft its own prices say will not pay
        # Whether they declined is the machine's timing of the moment, not behaviour: on
        # this noisy 2-core host 1 run in 4 measured prices at which every step paid (at
        # f0dacec and 18c9782 alike), so the test holds the decision to the prices only.
        if all(gain < MIN_GAIN for gain, _ in seen):
            assert measured.timings.drafted == 0 and decodes == []  # not even the prompt was read

        solo = [alone(engine, p, sampling=GREEDY, max_tokens=24) for p in prompts]
        assert measured.tokens == solo[0].tokens
        force_paying_prices(engine)
        exact = [engine.complete(p, sampling=GREEDY, max_tokens=24, lookup=EXACT_GREEDY) for p in prompts]
        wide = [engine.complete(p, sampling=GREEDY, max_tokens=24, lookup=NO_LOOKUP) for p in prompts]
    assert [e.tokens for e in exact] == [s.tokens for s in solo]
    assert any(w.tokens == s.tokens for w, s in zip(wide, solo))
    for answer in exact + wide:
        assert answer.timings.drafted > 0 and answer.timings.accepted > answer.timings.drafted / 2
    assert sum(a.timings.drafted - a.timings.accepted for a in exact + wide) > 0  # some were rejected


def test_a_model_drafting_for_itself_keeps_sampled_tokens(qwen_coder_gguf, monkeypatch):
    """Qwen2.5-Coder-0.5B as its own draft model at temperature 0.8, seeded: the draft is
    the greedy token, the target samples, so drafts are kept and rejected; the tokens are
    those without a draft model. Loaded with repack=False and flash attention on, and at
    most 6 tokens drafted: its rows are then bit-identical to one-row steps' on this CPU
    (a step of 8 rows or more moves them by ~0.4 logits, and repacked weights by 0.2-0.35
    at any width: enough to change a seeded draw, drafts or not)."""
    monkeypatch.setenv(FLASH_ATTN_ENV, "on")
    with Engine.open(qwen_coder_gguf, n_ctx=256, repack=False, draft=qwen_coder_gguf, draft_max=6) as engine:
        prompt = chat(engine, "Write one sentence about owls.")
        force_paying_prices(engine)
        drafted = rejected = 0
        for seed in range(3):
            sampling = SamplingParams(temperature=0.8, seed=seed)
            off = alone(engine, prompt, sampling=sampling, max_tokens=20)
            on = engine.complete(prompt, sampling=sampling, max_tokens=20, lookup=NO_LOOKUP)
            assert on.tokens == off.tokens, (seed, on.text, off.text)
            drafted += on.timings.drafted
            rejected += on.timings.drafted - on.timings.accepted
    assert drafted > rejected > 0


# -- 8. MLX ---------------------------------------------------------------------------------


def test_mlx_model_drafting_for_itself(smollm2_mlx):
    """MLX SmolLM2 as its own draft model, greedy, prices forced to pay: the answer of the
    target alone, with drafts kept (MLX decodes ~3 tokens/s on this CPU: a short answer)."""
    with Engine.open(smollm2_mlx, n_ctx=256, draft=smollm2_mlx) as engine:
        assert engine.draft_model is not None and engine.draft_model.backend.info.backend == "mlx"
        prompt = chat(engine, "List the days of the week.")
        off = alone(engine, prompt, sampling=GREEDY, max_tokens=8)
        force_paying_prices(engine)
        on = engine.complete(prompt, sampling=GREEDY, max_tokens=8, lookup=NO_LOOKUP)
    assert on.tokens == off.tokens, (on.text, off.text)
    assert on.timings.accepted > 0


# -- 9. the server ----------------------------------------------------------------------------


def test_serve_with_a_draft_model_answers_concurrent_requests_as_without(smollm2_gguf, tmp_path, monkeypatch):
    """`serve --model M --draft M --parallel 2` in process (the real app, model manager,
    scheduler and engine), prices forced to pay: two concurrent completions (greedy, and
    seeded at temperature 1), whose steps the scheduler shares (each draft priced in a
    step of two streams), answer what the server without --draft answers.

    SmolLM2 drafting for itself, flash attention on: its rows are then bit-identical in
    every batch shape here, so any difference is the drafts'. (Qwen2.5-Coder-0.5B was
    tried first: its rows move by ~0.4 logits once a step holds 8 rows or more, even with
    repack=False, and the answers of two concurrent streams then differ with the batch
    shapes, drafts or not.)"""
    from starlette.testclient import TestClient

    from localrun.server.app import build_app
    from localrun.server.models import ModelManager

    for var, name in (("LOCALRUN_MODELS", "store"), ("HF_HUB_CACHE", "hf"), ("LOCALRUN_LMSTUDIO_MODELS", "lms")):
        (tmp_path / name).mkdir()
        monkeypatch.setenv(var, str(tmp_path / name))
    monkeypatch.setenv(FLASH_ATTN_ENV, "on")
    monkeypatch.setattr(DraftModel, "step_delta", lambda self, cost: 0.05)
    monkeypatch.setattr(DraftModel, "read_delta", lambda self, cost: 0.0)
    shares, drafts, verdicts = [], [], []
    real_draft, real_record = DraftModelProposer.draft, DraftModelProposer.record

    def recorded(self, judged, accepted):
        if judged:
            verdicts.append((judged, accepted))
        real_record(self, judged, accepted)

    def paying(self, history, room, share=ALONE):
        self.cost.ratios = paying_ratios  # the engine's StepCost, for its draft model only
        try:  # priced as one pass: on llama.cpp a lone draft beside the other stream is its own
            # pass (StepShare), which these prices would decline; the drafts in shared steps are the point
            out = real_draft(self, history, room, dataclasses.replace(share, split=None))
        finally:
            del self.cost.ratios
        shares.append(share)
        drafts.append(len(out))
        return out

    monkeypatch.setattr(DraftModelProposer, "draft", paying)
    monkeypatch.setattr(DraftModelProposer, "record", recorded)
    name = smollm2_gguf.stem
    # greedy, and seeded at temperature 1: there the greedy drafts are often rejected,
    # so the target's KV is cut back while the other stream shares its steps
    asks = [{"prompt": "def fibonacci(n):\n", "temperature": 0},
            {"prompt": "The days of the week are", "temperature": 1.0, "seed": 3}]

    def answers(draft: str | None) -> list[str]:
        manager = ModelManager([str(smollm2_gguf)], n_ctx=256, parallel=2, threads=1, max_queue=4, draft=draft)
        out: list = [None, None]
        start = threading.Barrier(2)
        with TestClient(build_app(manager), base_url="http://127.0.0.1") as client:
            assert client.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 1}).status_code == 200

            def ask(i: int) -> None:
                start.wait()
                r = client.post("/v1/completions", json={"model": name, "max_tokens": 16, **asks[i]})
                out[i] = r.json() if r.status_code == 200 else r.text

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
        assert all(isinstance(o, dict) for o in out), out
        return [o["choices"][0]["text"] for o in out]

    without = answers(None)
    assert drafts == []
    with_draft = answers(str(smollm2_gguf))
    assert with_draft == without
    assert sum(drafts) > 0  # the draft model drafted...
    assert any(s.tokens == 2 and n > 0 for s, n in zip(shares, drafts))  # ...in steps both streams shared
    assert any(a == j for j, a in verdicts) and any(a < j for j, a in verdicts)  # drafts kept, drafts rejected
