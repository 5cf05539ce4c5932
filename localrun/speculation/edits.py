"""Edits an answer makes to the text it copies, learned so that prompt-lookup drafts
make them too (see `LearnedEdits`; the drafting itself is in lookup.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..sampling import TokenText

MAX_EDIT = 4  # tokens on either side of an edit the answer makes to what it copies (longer: a rewrite)
MAX_EDITS = 32  # learned edits kept per answer

Edit = tuple[tuple[int, ...], tuple[int, ...]]  # (the tokens copied from, what the answer wrote instead)
# How far after a dropped opening bracket its closer is looked for, in source tokens.
MIRROR_REACH = 64
_CLOSER = {ord("("): ord(")"), ord("["): ord("]"), ord("{"): ord("}")}
_CLOSERS = frozenset(_CLOSER.values())


class LearnedEdits:
    """Edits the answer made to the text it copies, so that drafts make them too.

    A draft that copied from history position s failed at answer position p; when the
    answer then agrees with the source again from source position s2 at answer position
    p2, it wrote history[p:p2] where the source had history[s:s2]. When both spans are
    short, that is an edit the answer is making (a rename: `entry` -> `record`), which it
    will likely make at the next occurrence too: drafts copy with it from then on, and a
    match goes on behind it. An edit that a draft fails at is forgotten. Without this,
    every occurrence of a renamed name ends a draft, and the draft after it rests on a
    short match that may point at the wrong occurrence.

        h = [1, 7, 2, 3, 9, 1, 8, 2, 3]   # 1 7 2 3 was copied as 1 8 2 3
        edits = LearnedEdits()
        edits.missed(source=1, answer=6)  # a draft copying from 0 failed at 6 (8, not 7)
        edits.resync(h)  # 2 3 agrees again after it: 7 -> 8 is learned
        edits.copy(h, 0, 4)  -> ([1, 8, 2, 3], [(0, None), (1, ((7,), (8,))), (2, None), (3, None)])

    With the vocabulary's spelling (a `TokenText`: tokens as bytes, text as tokens), an
    edit that drops an opening bracket the source had also drops the bracket that closed
    it there: SmolLM2 copies `append(("short", raw))` as `append("short", raw)`, and
    without the mirror the draft that follows the learned `(` fails at `))` (a 13-row
    step that kept 2 tokens, on the rename task of scripts/bench/bench_lookup.py). The mirror
    is an edit of that one source token, not of every `))`.
    """

    def __init__(self, capacity: int = MAX_EDITS, spelling: TokenText | None = None) -> None:
        self.capacity = capacity  # 0: learn nothing
        self.spelling = spelling  # None: no bracket is mirrored
        self._by_first: dict[int, list[Edit]] = {}  # first source token -> edits, longest first
        self._drops: dict[Edit, int] = {}  # edits that drop an opening bracket -> its byte in their old bytes
        self._mirrors: dict[int, Edit] = {}  # source index -> the edit of that one token
        self._count = 0
        self._miss: tuple[int, int] | None = None  # (source, answer) index of a failed draft token

    def __len__(self) -> int:
        return self._count + len(self._mirrors)

    def missed(self, source: int, answer: int) -> None:
        """A draft token copied from `source` was not what the answer wrote at `answer`."""
        left_out = [i for i in range(source - MAX_EDIT, source) if self._mirrors.get(i, (None, None))[1] == ()]
        if left_out:  # a mirror left a token out just before: the answer kept it, and copies on
            del self._mirrors[left_out[-1]]
            return
        self._miss = (source, answer)

    def resync(self, history: list[int]) -> None:
        """While a miss is pending: if the answer since it copies the source again right
        after a short edit (at least two tokens agreeing after it), learn that edit. The
        smallest edit that explains the answer wins; a miss that nothing explains within a
        few tokens is dropped (the answer left the copy)."""
        if self._miss is None:
            return
        s, p = self._miss
        n = len(history)
        if n - p > 2 * MAX_EDIT + 2:
            self._miss = None
            return
        for size in range(1, 2 * MAX_EDIT + 1):
            for wrote in range(max(0, size - MAX_EDIT), min(size, MAX_EDIT) + 1):
                a, b = p + wrote, s + size - wrote  # where the answer and the source go on agreeing
                agree = n - a
                if agree >= 2 and b + agree <= p and history[a:n] == history[b : b + agree]:
                    self._miss = None
                    self._learn(history, tuple(history[s:b]), tuple(history[p:a]), s, p)
                    return

    def _learn(self, history: list[int], old: tuple[int, ...], new: tuple[int, ...], s: int, p: int) -> None:
        if not old or not new:
            # An insertion or a deletion: anchor it on the token before, which both copies
            # share. Unanchored, a deletion would drop that token from every later copy:
            # SmolLM2 wrote `append(("short", raw))` as `append("short", raw)`, and its
            # drafts then wrote `float(parts[0])` as `floatparts[0])`.
            if s == 0 or history[s - 1] != history[p - 1]:
                return
            old, new, s = (history[s - 1], *old), (history[p - 1], *new), s - 1
        if old != new and self._count < self.capacity and (old, new) not in self._by_first.get(old[0], ()):
            edits = self._by_first.setdefault(old[0], [])
            edits.append((old, new))
            edits.sort(key=lambda e: -len(e[0]))
            self._count += 1
            drop = self._dropped_bracket(old, new)
            if drop is not None:
                self._drops[(old, new)] = drop
                self._mirror(history, s, (old, new), p)

    def _dropped_bracket(self, old: tuple[int, ...], new: tuple[int, ...]) -> int | None:
        """Where in old's bytes the opening bracket sits that `new` leaves out, when
        leaving it out is all the edit does (None: it is not, or no spelling)."""
        if self.spelling is None or self.spelling.tokenize is None:
            return None
        was = b"".join(map(self.spelling.piece, old))
        now = b"".join(map(self.spelling.piece, new))
        if len(was) != len(now) + 1:
            return None
        at = next((i for i in range(len(now)) if was[i] != now[i]), len(now))
        return at if was[at] in _CLOSER and was[:at] + was[at + 1 :] == now else None

    def _mirror(self, text: list[int], s: int, edit: Edit, end: int) -> None:
        """`edit` copies text[s:] dropping an opening bracket: the token of text[s:end]
        that closes it is copied without its closer too (the answer keeps its brackets
        balanced). Brackets inside strings are counted as any other."""
        old, _ = edit
        depth, skip, opener = 0, self._drops[edit], None  # skip: bytes before the dropped bracket
        for i in range(s, min(end, s + MIRROR_REACH)):
            piece = self.spelling.piece(text[i])
            for j, byte in enumerate(piece):
                if skip:
                    skip -= 1
                elif opener is None:
                    opener, depth = byte, 1
                elif byte in _CLOSER:
                    depth += 1
                elif byte in _CLOSERS:
                    depth -= 1
                    if depth == 0:
                        if byte == _CLOSER[opener] and i >= s + len(old) and i not in self._mirrors:
                            self._mirror_at(i, text[i], piece[:j] + piece[j + 1 :])
                        return

    def _mirror_at(self, i: int, token: int, rest: bytes) -> None:
        """Copy source token i as `rest` from now on."""
        try:
            wrote = tuple(self.spelling.tokenize(rest.decode("utf-8"))) if rest else ()
        except UnicodeDecodeError:  # the bracket sat beside part of a character
            return
        if len(self._mirrors) >= self.capacity:  # the oldest is likely one the answer is past
            del self._mirrors[next(iter(self._mirrors))]
        self._mirrors[i] = ((token,), wrote)

    def forget(self, edit: Edit, at: int | None = None) -> None:
        """The answer did not make `edit` where source index `at` was copied."""
        if at is not None and self._mirrors.get(at) == edit:
            del self._mirrors[at]
            return
        edits = self._by_first.get(edit[0][0], [])
        if edit in edits:
            edits.remove(edit)
            self._drops.pop(edit, None)
            self._count -= 1

    def _at(self, history: list[int], i: int) -> Edit | None:
        """The edit to make to the source at i: none where the text already reads as
        edited (a copy of the answer's own earlier text)."""
        mirror = self._mirrors.get(i)
        if mirror is not None and history[i] == mirror[0][0]:
            return mirror
        for old, new in self._by_first.get(history[i], ()):
            if tuple(history[i : i + len(old)]) != old:
                continue
            # a deletion's `new` is the start of its `old`: reading so is no sign of the edit made
            if new == old[: len(new)] or tuple(history[i : i + len(new)]) != new:
                return old, new
        return None

    def copy(self, history: list[int], start: int, k: int,
             loop: bool = False) -> tuple[list[int], list[tuple[int, Edit | None]]]:
        """Up to k tokens copied from history[start:] with the learned edits made, and
        where each came from: (source index, the edit that wrote it or None). A copy that
        reaches the history's end goes on copying what it drafted, as the answer would if
        it repeats itself: behind a match that ends d tokens back, a loop of period d
        drafts k tokens, not d - 1."""
        out: list[int] = []
        origins: list[tuple[int, Edit | None]] = []
        text, i = history, start  # text: the history, then the history and the draft so far
        while len(out) < k:
            if i >= len(text):
                if not loop or text is not history or not out:
                    break
                text = history + out
            edit = self._at(text, i) if self._count or self._mirrors else None
            wrote = (text[i],) if edit is None else edit[1]
            if edit in self._drops and text is history:
                self._mirror(history, i, edit, len(history))
            out.extend(wrote)
            origins.extend((i, edit) for _ in wrote)
            if text is not history:
                text.extend(wrote)
            i += 1 if edit is None else len(edit[0])
        return out[:k], origins[:k]

    def extend(self, history: list[int], a: int, b: int, length: int, limit: int) -> int:
        """A match of `length` tokens whose first disagreement is answer index a against
        source index b, extended backwards across learned edits (answer tokens counted),
        up to `limit`."""
        while (self._count or self._mirrors) and length < limit and b >= 0 and a > b:
            if history[a] == history[b]:
                a, b, length = a - 1, b - 1, length + 1
                continue
            mirror = self._mirrors.get(b)
            if (mirror is not None and history[b] == mirror[0][0] and a - len(mirror[1]) >= b
                    and tuple(history[a - len(mirror[1]) + 1 : a + 1]) == mirror[1]):
                a, b, length = a - len(mirror[1]), b - 1, length + len(mirror[1])
                continue
            edit = next((e for edits in self._by_first.values() for e in edits
                         if a - len(e[1]) + 1 > b and b - len(e[0]) + 1 >= 0
                         and tuple(history[a - len(e[1]) + 1 : a + 1]) == e[1]
                         and tuple(history[b - len(e[0]) + 1 : b + 1]) == e[0]), None)
            if edit is None:
                break
            a, b, length = a - len(edit[1]), b - len(edit[0]), length + len(edit[1])
        return min(length, limit)
