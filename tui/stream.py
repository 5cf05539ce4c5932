"""How an answer travels from the decode thread to the screen without slowing decoding.

The decode thread only appends to an `AnswerFeed` (a lock held for a list append: it never
waits for the UI, and nothing is queued on the event loop per token). The UI takes
everything the feed holds once a frame, on a timer, and draws it in one Markdown append
and one status update. `FramePacer` decides when a frame is due: at most `FRAME_HZ` a
second, and less often when drawing gets expensive, so the UI thread's share of a CPU
stays under `MAX_UI_SHARE` however long the answer grows (Textual re-parses the answer's
last Markdown block on every append, and a long code block is one block).

Why it matters: on a 2-core machine llama.cpp runs one thread per core, so every moment
the UI thread computes stalls a decode step, and while it holds the GIL the decode thread
waits to sample. Drawing each token as it came made the app decode at ~0.6x the CLI.
"""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass, field

FRAME_HZ = 15  # frames a second at most: smooth to read, a small fraction of a core to draw
# the UI thread's CPU time between two frames stays under 2% of the wall time: on a 2-core
# machine llama.cpp runs a thread per core and waits for the slowest, so the UI's share
# of a core comes off decoding one for one and a little more (GIL hand-offs; issue 16
# allows the app 5% in all). A frame of a scrolling answer costs Textual ~15-30 ms of
# layout and rendering here (160x40), so in practice the gap below sets the pace.
MAX_UI_SHARE = 0.02
# however busy the UI thread is (input, layout, a test's pilot all count as its CPU), the
# answer on screen is never older than this: the share rule only thins frames out.
# Measured (scripts/bench/bench_chat_app.py, SmolLM2, 2 threads): 0.5 s gave app / cli
# 0.88-0.94, 0.75 s 0.98-1.1
MAX_FRAME_GAP_S = 0.75
GIL_SWITCH_S = 0.001  # while the app runs: how long a thread holding the GIL keeps a waiting one out


@dataclass
class Batch:
    """What arrived since the last frame: pieces in order, each (text, tool call deltas or
    None), and the latest timings (None when nothing arrived)."""

    pieces: list[tuple[str, list | None]] = field(default_factory=list)
    timings: object | None = None
    thinking: str = ""  # the thinking that arrived (drawn in its own folded block, apart from the pieces)


class AnswerFeed:
    """The decode thread's outbox. `put` is called per token on the decode thread; `take`
    on the UI thread returns everything put since the last `take`, in order, exactly once.

        feed = AnswerFeed()
        feed.put("Hel", t1); feed.put("lo", t2)
        feed.take()  -> Batch([("Hel", None), ("lo", None)], t2)
        feed.take()  -> Batch([], None)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pieces: list[tuple[str, list | None]] = []
        self._thinking: list[str] = []
        self._timings = None

    def put(self, text: str, timings, tool_calls: list | None = None, thinking: str = "") -> None:
        with self._lock:  # held only for an append: never for as long as a frame takes to draw
            if text or tool_calls:
                self._pieces.append((text, tool_calls))
            if thinking:
                self._thinking.append(thinking)
            self._timings = timings

    def take(self) -> Batch:
        with self._lock:
            pieces, self._pieces = self._pieces, []
            thinking, self._thinking = self._thinking, []
            timings, self._timings = self._timings, None
        return Batch(pieces, timings, "".join(thinking))


class FramePacer:
    """When the next frame may be drawn, from two clocks the caller reads: wall time and
    the UI thread's CPU time (`time.thread_time()` on the event loop's thread).

    A frame is due when at least 1/hz has passed since the last one AND the UI thread's
    CPU time since then (drawing the last frame, layout, input) is at most `max_share` of
    the wall time since then, and always once `max_gap` seconds have passed. So cheap
    frames come at `hz`; with the default share, a frame that cost 6 ms of CPU keeps the
    next one 6 / 0.03 = 200 ms away; a UI thread kept busy by other work still shows the
    answer every `max_gap` seconds.

        p = FramePacer(hz=10, max_share=0.1)
        p.due(0.0, 0.0)   -> True   (the first frame)
        p.drawn(0.0, 0.0)
        p.due(0.05, 0.0)  -> False  (under 1/10 s since the last)
        p.due(0.1, 0.05)  -> False  (50 ms of UI CPU in 100 ms: over 10%)
        p.due(0.5, 0.05)  -> True   (50 ms in 500 ms: 10%)
    """

    def __init__(self, hz: float = FRAME_HZ, max_share: float = MAX_UI_SHARE, max_gap: float = MAX_FRAME_GAP_S) -> None:
        if hz <= 0 or not 0 < max_share <= 1 or max_gap < 1.0 / hz:
            raise ValueError(f"frame rate must be > 0, the UI share in (0, 1] and the longest gap at least"
                             f" one frame, got {hz}, {max_share} and {max_gap}")
        self.interval = 1.0 / hz
        self.max_share = max_share
        self.max_gap = max_gap
        self._last: tuple[float, float] | None = None  # (wall, UI CPU) when the last frame was drawn

    def due(self, wall: float, cpu: float) -> bool:
        if self._last is None:
            return True
        elapsed = wall - self._last[0]
        if elapsed >= self.max_gap:
            return True
        return elapsed >= self.interval and cpu - self._last[1] <= self.max_share * elapsed

    def drawn(self, wall: float, cpu: float) -> None:
        self._last = (wall, cpu)


class CollectorPause:
    """Keeps Python's full garbage collections out of an answer.

    A full (oldest-generation) collection walks every tracked object while holding the
    GIL: with a model, Textual and a conversation loaded that is ~100k objects and 60-90
    ms here, once or twice an answer, on the UI thread. All that time the decode thread
    cannot take the GIL to sample, so the whole step waits (measured: app / cli 0.86 with
    it, 1.03 without, on a 400-token SmolLM2 answer). `hold()` moves every object that
    exists when the answer starts out of the collector's sight (`gc.freeze`), so only what
    the answer itself allocates is scanned; `release()` hands them back, and their garbage
    is collected between answers as usual. Young collections (a few ms) still run.

        pause = CollectorPause()
        pause.hold()      # answer starts: gc.get_freeze_count() > 0
        pause.release()   # answer done: gc.get_freeze_count() == 0
    """

    def __init__(self) -> None:
        self.held = False

    def hold(self) -> None:
        if not self.held:
            gc.freeze()
            self.held = True

    def release(self) -> None:
        if self.held:
            gc.unfreeze()
            self.held = False


# code fences the models here write most; a language's first fence costs its lexer's
# rule compilation (Python's: ~35 ms), paid once per process
WARM_LANGUAGES = ("python", "bash", "json", "javascript", "c", "cpp")


def warm_highlighter(languages=WARM_LANGUAGES) -> None:
    """Compile the syntax highlighter's rules for common languages now, off the answer's
    path: otherwise the first frame that shows a code fence compiles them on the UI
    thread, holding the GIL while the decode thread waits to sample. Called once, on
    the worker thread that loads the first model."""
    from textual.highlight import highlight

    for language in languages:
        highlight("x\n", language=language)
