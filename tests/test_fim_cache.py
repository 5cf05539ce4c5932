"""Fill-in-the-middle prompts keep the slot's cache warm while the user types: the token
layout of both orders (prefix-suffix-middle, suffix-prefix-middle), and on a real code
model (Qwen2.5-Coder) that a keystroke re-reads only a few tokens in both shapes editors
send: llama.vim's (the cursor's line in `prompt`) and the whole-prefix one (Continue, Zed,
Ollama's and OpenAI's `suffix`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from localrun.server import fim
from localrun.server.fim import fim_tokens

PRE, SUF, MID, BOS = 1, 2, 3, 9


def fake_engine(prefix_text: str = "<|fim_prefix|>", n_ctx: int = 4096, add_bos: bool = False):
    """One token per character (id = code point + 1000), FIM ids 1/2/3, BOS 9."""
    info = SimpleNamespace(fim_prefix_id=PRE, fim_suffix_id=SUF, fim_middle_id=MID, bos_id=BOS, add_bos=add_bos)
    backend = SimpleNamespace(token_text=lambda t: prefix_text if t == PRE else "?")
    return SimpleNamespace(info=info, backend=backend, n_ctx=n_ctx,
                           tokenize=lambda text, add_special=False: [ord(c) + 1000 for c in text])


def ids(text: str) -> list[int]:
    return [ord(c) + 1000 for c in text]


def test_psm_layout_puts_the_cursors_line_after_the_middle_mark():
    eng = fake_engine(add_bos=True)
    assert fim_tokens(eng, "a = 1\nb = ", "\nc = 3\n", middle="x") == (
        [BOS, PRE] + ids("a = 1\n") + [SUF] + ids("\nc = 3\n") + [MID] + ids("b = x"))
    # llama.vim's shape (the cursor's line in `prompt`) and the whole-prefix shape: one prompt
    assert fim_tokens(eng, "a = 1\n", "z", middle="b = ") == fim_tokens(eng, "a = 1\nb = ", "z")
    assert fim_tokens(fake_engine(), "", "") == [PRE, SUF, MID]
    assert fim_tokens(fake_engine(), "one line", "") == [PRE, SUF, MID] + ids("one line")


def test_a_cursor_line_too_long_for_the_middle_stays_in_the_prefix():
    line = "x" * (fim.CURSOR_LINE_MAX + 1)
    assert fim_tokens(fake_engine(), "a\n" + line, "z") == [PRE] + ids("a\n" + line) + [SUF] + ids("z") + [MID]
    # a line of more tokens than a quarter of the budget, which the prefix's cut may shorten
    assert fim_tokens(fake_engine(), "a\n" + "y" * 60, "z", budget=203) == [PRE] + ids("a\n" + "y" * 60) + [SUF] + ids("z") + [MID]
    assert fim_tokens(fake_engine(), "a\n" + "y" * 40, "z", budget=203) == [PRE] + ids("a\n") + [SUF] + ids("z") + [MID] + ids("y" * 40)


def test_spm_for_code_llama_puts_everything_before_the_cursor_last():
    for piece in ("▁<PRE>", "<PRE>"):
        eng = fake_engine(piece, add_bos=True)
        assert fim_tokens(eng, "a = 1\nb = ", "\nc = 3\n", middle="x") == (
            [BOS, PRE, SUF] + ids("\nc = 3\n") + [MID] + ids("a = 1\nb = x"))
        # llama.vim's shape (the cursor's line in `prompt`) and the whole-prefix shape: one prompt
        assert fim_tokens(eng, "a = 1\n", "z", middle="b = ") == fim_tokens(eng, "a = 1\nb = ", "z")


def test_input_extra_goes_before_the_prefix_in_both_orders():
    extra = [("util.py", "def h(): pass"), ("", "note")]
    context = ids("util.py\ndef h(): pass\nnote\n")
    assert fim_tokens(fake_engine(), "p\nq", "s", extra) == [PRE] + context + ids("p\n") + [SUF] + ids("s") + [MID] + ids("q")
    assert fim_tokens(fake_engine("▁<PRE>"), "p\nq", "s", extra) == [PRE, SUF] + ids("s") + [MID] + context + ids("p\nq")


@pytest.mark.parametrize("piece", ["<|fim_prefix|>", "▁<PRE>"])
def test_the_cut_keeps_the_text_nearest_the_cursor(piece):
    eng = fake_engine(piece)
    prefix, suffix = "".join(f"p{i:03d}\n" for i in range(100)), "".join(f"s{i:03d}\n" for i in range(100))
    tokens = fim_tokens(eng, prefix, suffix, budget=203)  # room 200: the suffix keeps a quarter
    assert len(tokens) == 203
    text = "".join(chr(t - 1000) if t >= 1000 else "|" for t in tokens)
    kept_suffix = suffix[:50]
    kept_prefix = prefix[-150:]  # the prefix loses its start, the suffix its end
    expected = (f"||{kept_suffix}|{kept_prefix}" if piece == "▁<PRE>" else f"|{kept_prefix}|{kept_suffix}|")
    assert text == expected


def test_no_fim_tokens_is_a_bad_request():
    eng = fake_engine()
    eng.info.fim_middle_id = None
    with pytest.raises(Exception, match="fill-in-the-middle"):
        fim_tokens(eng, "a", "b")


# -- a real FIM model's slot cache ------------------------------------------------------


def code_file(variant: int, n_funcs: int = 12) -> tuple[str, str]:
    """Python text before and after a cursor in the second-to-last function, after
    `total += ` (bench_serve's FIM file, smaller), every line depending on `variant`."""
    funcs = [f"def restock_{variant}_{i}(items, scale={i + 2}):\n"
             f'    """Weighted stock of every {i + 3}th item, scaled by {i + 2}."""\n'
             f"    total = {i + variant}\n"
             f"    for index, item in enumerate(items):\n"
             f"        if index % {i + 3} == 0:\n"
             f"            total += item.count * scale\n"
             f"    return total\n" for i in range(n_funcs)]
    text = f"# inventory {variant}\nimport math\n\n" + "\n\n".join(funcs)
    cut = text.rindex("total += ", 0, text.rindex("def ")) + len("total += ")
    return text[:cut], text[cut:]


@pytest.fixture(scope="module")
def coder(qwen_coder_gguf):
    from localrun.engine import Engine

    with Engine.open(qwen_coder_gguf, n_ctx=2048, n_seq=1) as eng:  # one slot: every request meets the last
        yield eng


def reread(eng, tokens: list[int]) -> int:
    """Prompt tokens the slot had to read (not found in its cache) for this request."""
    t = eng.complete(tokens, max_tokens=1).timings
    assert t.prompt_tokens == len(tokens)
    return t.prompt_tokens - t.cached_tokens


def test_psm_typing_rereads_a_few_tokens_in_llama_vims_shape(coder):
    before, after = code_file(7)
    line = before.rindex("\n") + 1
    assert reread(coder, fim_tokens(coder, before[:line], after, middle=before[line:])) > 300
    # typing goes to `prompt`, after <MID>
    assert reread(coder, fim_tokens(coder, before[:line], after, middle=before[line:] + "item.")) <= 4
    assert reread(coder, fim_tokens(coder, before[:line], after, middle=before[line:] + "item.count")) <= 4


def test_psm_typing_rereads_a_few_tokens_in_the_whole_prefix_shape(coder):
    """Continue's, Zed's, Ollama's and OpenAI's shape: the whole text before the cursor in
    the prefix. Its cursor line goes after <MID> too, so a keystroke re-reads what it typed,
    not <SUF> suffix <MID> after it (more than 40 tokens here), nor the file before it."""
    before, after = code_file(8)
    suffix = len(coder.tokenize(after, add_special=False))
    assert suffix > 40
    assert reread(coder, fim_tokens(coder, before, after)) > 300
    assert reread(coder, fim_tokens(coder, before + "item.", after)) <= 4
    assert reread(coder, fim_tokens(coder, before + "item.count", after)) <= 4
    # a new line: the finished line joins the prefix, so the suffix is read again, once a line
    newline = reread(coder, fim_tokens(coder, before + "item.count\n            total += ", after))
    assert suffix < newline <= suffix + 40
    assert reread(coder, fim_tokens(coder, before + "item.count\n            total += 1", after)) <= 4


def test_spm_typing_rereads_a_few_tokens_in_both_shapes(coder, monkeypatch):
    # Qwen2.5-Coder is a PSM model: forcing SPM checks that layout's cache use on real tokens
    monkeypatch.setattr(fim, "suffix_first", lambda engine: True)
    before, after = code_file(9)
    line = before.rindex("\n") + 1
    assert len(coder.tokenize(after, add_special=False)) > 40  # what PSM re-reads per keystroke here
    assert reread(coder, fim_tokens(coder, before[:line], after, middle=before[line:])) > 300
    # llama.vim's shape, then the same text in the whole-prefix shape (bench_serve's order)
    assert reread(coder, fim_tokens(coder, before[:line], after, middle=before[line:] + "item.")) <= 4
    assert reread(coder, fim_tokens(coder, before + "item.", after)) <= 4
    # an editor that always sends the whole prefix, typing on, a new line included
    assert reread(coder, fim_tokens(coder, before + "item.count", after)) <= 4
    assert reread(coder, fim_tokens(coder, before + "item.count\n            total += ", after)) <= 10


# cursor lines a tokenizer cuts where the model would write one token: each line's text up
# to the cursor, and how the healed line must begin (raw, Qwen2.5-Coder wrote "def  divide",
# "x = math.sqroot(16)" and "for n in naames")
CUT_LINES = [
    ("def add(a, b):\n    return a + b\n\n\ndef ", "(a, b):\n    return a * b\n", r"def \w"),
    ("import math\n\nx = math.sq", "\nprint(x)\n", r"x = math\.sqrt"),
    ("names = ['ann', 'bob']\nfor n in na", ":\n    print(n)\n", r"for n in names\b"),
]


@pytest.mark.parametrize("before, after, healed_line", CUT_LINES)
def test_token_healing_writes_the_cut_token_whole(coder, before, after, healed_line):
    """The FIM prompt ends at the cursor, after <MID>; healed, the answer's first tokens
    write the text taken off the prompt again (its bytes begin the answer's), and the
    answer's text goes on after it."""
    import re

    from localrun.prompt.healing import HEAL_MOST
    from localrun.sampling import SamplingParams

    tokens = fim_tokens(coder, before, after)
    done = coder.complete(tokens, sampling=SamplingParams(temperature=0), max_tokens=6, token_healing=True)
    cut = done.timings.prompt_tokens
    assert 1 <= len(tokens) - cut <= HEAL_MOST
    taken = b"".join(coder.backend.token_bytes(t) for t in tokens[cut:])
    written = b"".join(coder.backend.token_bytes(t) for t in done.tokens)
    assert written.startswith(taken) and written[len(taken):].decode() == done.text
    line = before[before.rfind("\n") + 1:]
    assert re.match(healed_line, line + done.text), line + done.text
