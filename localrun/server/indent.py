"""llama-server's `n_indent` for editor completions (llama.vim sends the indentation of
the cursor's line): the completion ends where a later line starts its content with less
indentation than that, because such a line has left the block being completed. The
first line continues the cursor's own line and is never cut."""

from __future__ import annotations


class IndentLimit:
    """Fed the answer's text piece by piece; says where it must be cut."""

    def __init__(self, n_indent: int) -> None:
        self.n_indent = n_indent
        self._indent: int | None = None  # spaces/tabs so far on the current line; None on the first line
        self._content = False  # the current line has shown a non-blank character

    def cut(self, text: str) -> int | None:
        """The offset in `text` of the first character of an under-indented line's
        content (what follows it is dropped), or None when the text may all go out."""
        for i, ch in enumerate(text):
            if ch == "\n":
                self._indent, self._content = 0, False
            elif self._indent is None or self._content:
                continue
            elif ch in " \t":
                self._indent += 1
            else:
                self._content = True
                if self._indent < self.n_indent:
                    return i
        return None
