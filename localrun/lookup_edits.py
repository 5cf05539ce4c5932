"""Edits an answer makes to the text it copies, learned so that prompt-lookup drafts
make them too (see `LearnedEdits`; the drafting itself is in speculative.py)."""

from __future__ import annotations

MAX_EDIT = 4  # tokens on either side of an edit the answer makes to what it copies (longer: a rewrite)
MAX_EDITS = 32  # learned edits kept per answer

Edit = tuple[tuple[int, ...], tuple[int, ...]]  # (the tokens copied from, what the answer wrote instead)


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
    """

    def __init__(self, capacity: int = MAX_EDITS) -> None:
        self.capacity = capacity  # 0: learn nothing
        self._by_first: dict[int, list[Edit]] = {}  # first source token -> edits, longest first
        self._count = 0
        self._miss: tuple[int, int] | None = None  # (source, answer) index of a failed draft token

    def __len__(self) -> int:
        return self._count

    def missed(self, source: int, answer: int) -> None:
        """A draft token copied from `source` was not what the answer wrote at `answer`."""
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
            old, new = (history[s - 1], *old), (history[p - 1], *new)
        if old != new and self._count < self.capacity and (old, new) not in self._by_first.get(old[0], ()):
            edits = self._by_first.setdefault(old[0], [])
            edits.append((old, new))
            edits.sort(key=lambda e: -len(e[0]))
            self._count += 1

    def forget(self, edit: Edit) -> None:
        edits = self._by_first.get(edit[0][0], [])
        if edit in edits:
            edits.remove(edit)
            self._count -= 1

    def _at(self, history: list[int], i: int) -> Edit | None:
        """The edit to make to the source at i: none where the text already reads as
        edited (a copy of the answer's own earlier text)."""
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
            edit = self._at(text, i) if self._count else None
            wrote = (text[i],) if edit is None else edit[1]
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
        while self._count and length < limit and b >= 0 and a > b:
            if history[a] == history[b]:
                a, b, length = a - 1, b - 1, length + 1
                continue
            edit = next((e for edits in self._by_first.values() for e in edits
                         if a - len(e[1]) + 1 > b and b - len(e[0]) + 1 >= 0
                         and tuple(history[a - len(e[1]) + 1 : a + 1]) == e[1]
                         and tuple(history[b - len(e[0]) + 1 : b + 1]) == e[0]), None)
            if edit is None:
                break
            a, b, length = a - len(edit[1]), b - len(edit[0]), length + len(edit[1])
        return min(length, limit)
