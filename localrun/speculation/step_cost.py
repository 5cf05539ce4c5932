"""What a speculative step of r rows costs on this model, as a multiple of a one-row step.

The machine's speed is not a constant. On this project's shared 2-core CPU a one-row step
of SmolLM2 took 15.3 ms in one 10-second window and 20.9 ms two minutes later, while a
49-row step cost 24.1-28.3 one-row steps in every window of the same four minutes
(recorded with each width in turn after one prompt, widths 1-49 interleaved). So a step's
time is the machine's speed of the moment times the model's shape at that width:

    log ms = log speed(now) + log shape(rows),   shape(1) = 1,

and each step's time also scatters by itself (robust sd 0.075-0.096 in log around its
neighbours', for 1 to 49 rows, with a tail of steps that lost the core for a while).

`StepCost` follows both with one Kalman filter over the log speed and the log shape of
widths 2..MAX_ROWS: the speed is a random walk in time (so it follows drift), the shape
changes slowly (longer contexts cost wide steps more), and neighbouring widths share what
is learned about them (their prior covariance falls with their distance in log rows), so
one noisy measurement of 20 rows is weighed against 17 and 24 rather than kept alone.
A draft is priced by the shape only: the speed of the moment cancels out of "is a 20-row
step worth 20 tokens' chance". The engine times only steps that are one pass of decoding
rows (a single sequence's, or a server's streams' that the backend runs as one pass; a
step split into passes says nothing clean about one width: Speculator.observe).

Why not a ratio to recent one-row steps (localrun's earlier rule): a wide width measured
once keeps the moment it was measured in. Traced on SmolLM2's edit task, the prices
carried into an answer were 40-50% above a quiet table (20 rows at 15.2 one-row steps
against 9.1), and the answer drafted 5 tokens at a time at a 98% acceptance rate.
Replayed (scripts/lookup/replay_lookup.py --load TABLE --drift RECORD --drift-starts 12) on two
measured tables and two recorded drifts, the grounded tasks' geometric mean over
ngram-simple went from 1.25-1.27 / 1.09-1.14 / 1.14-1.18 to 1.29-1.31 / 1.13-1.17 /
1.17-1.23 (SmolLM2 / Gemma-3 / Qwen2.5); on the quiet tables alone, from 1.27-1.30 /
1.07-1.20 / 1.13-1.17 to 1.28-1.31 / 1.09-1.18 / 1.16-1.25. On the real engine (both rules
in one process, alternating, 3 rounds of the seven tasks), grounded tasks decoded 1.03 /
1.05 / 1.01x faster, chats 0.97 / 1.08 / 1.00x.

A width the filter judges too dear would never be drafted, so never measured again: the
price is optimistic by `OPTIMISM` standard deviations of what is known about the width,
and every step of a generation that may draft fades what was learned toward the prior
(STALE_STEPS). A width left unmeasured gets cheaper until it is tried: after a first
measurement slowed 4x by load, a 4-row step is drafted again after about 7000 steps, or
as soon as its neighbours' measurements say it is cheap (one slowed step of a width
measured before moves its price by under 10%: the surprise is bounded by `SPIKE`).
A lookup-off generation's steps follow the speed only: they could not have measured a
width, so they do not fade one.

Every step of every generation is observed, so observing must cost next to nothing: a
one-row step is queued, and taken (in O(1), see `_one_row`) when the filter is read. It
cost ~125 us a token in the engine loop when each step ran the 64x64 update at once.
"""

from __future__ import annotations

import math

import numpy as np


class StepCost:
    """One model's step cost by rows: the filter of the module's docstring, fed every
    one-pass step the engine times, read by LookupProposer as prices."""

    MAX_ROWS = 64  # widths the filter knows; wider steps are priced by extension (none drafts that wide today)
    JITTER = 0.08  # a step's own scatter, sd in log ms (measured 0.075-0.096, see above)
    # The speed's random walk, variance in log per ms of stepping: the recorded one-row
    # time moved by ~0.1 in log between neighbouring 10-second windows, up to 0.28 over 40 s.
    SPEED_DRIFT = 2.5e-6
    SHAPE_SD = 0.5  # prior sd of a width's log shape around the config's cost_per_draft line
    SHAPE_SCALE = 0.5  # widths this far apart in log rows share e^-1 of their prior covariance
    STALE_STEPS = 4096  # drafting steps over which an unmeasured width's estimate fades to the prior (1/e)
    AGE_EVERY = 16  # one-row steps fade the shape in bulk, this many at a time (it moves slowly)
    # A step more than this many sds slower (or faster) than expected counts as this
    # surprising: load that took the core for part of a step says nothing about the width
    # (two such steps in a row say the speed changed).
    SPIKE = 2.0
    OPTIMISM = 1.0  # the price is the mean less this many sds of the width's log shape
    # one-row steps held out of the shape's state at most (see _one_row): the held
    # scale shrinks ~8% a step and would reach the floats' denormals after thousands
    FOLD_AT_MOST = 256
    QUEUE_AT_MOST = 256  # one-row steps observed before they are taken, at most (see observe)

    def __init__(self, prior_per_row: float = 0.25) -> None:
        """`prior_per_row`: what a row costs (in one-row steps) before any was measured
        (LookupConfig.cost_per_draft's default, optimistic on purpose)."""
        widths = np.arange(2, self.MAX_ROWS + 1)
        log_widths = np.log(widths)
        # state: [log one-row ms, log shape(2), ..., log shape(MAX_ROWS)]
        self._prior_shape = np.log1p(prior_per_row * (widths - 1))
        self._prior_cov = self.SHAPE_SD ** 2 * np.exp(-np.abs(log_widths[:, None] - log_widths[None, :]) / self.SHAPE_SCALE)
        self._mean = np.concatenate([[0.0], self._prior_shape])
        self._cov = np.zeros((len(widths) + 1, len(widths) + 1))
        self._cov[0, 0] = 1.0  # the speed is unknown until the first step (which sets it)
        self._cov[1:, 1:] = self._prior_cov
        self._steps = 0
        self._unaged = 0  # drafting steps whose fading is not applied yet
        self._last_outlier = 0  # the sign of the last step's clipped surprise (0: it was not)
        # One-row steps not yet folded into the shape's part of the state (see _one_row):
        # cov[1:, 0] = a * u, cov[1:, 1:] = stored - beta * u u^T, mean[1:] = stored + delta * u.
        self._u = np.zeros(len(widths))
        self._a, self._beta, self._delta = 1.0, 0.0, 0.0
        self._folding = 0  # one-row steps held that way
        self._prices: list[float] | None = None  # computed when a draft is priced
        self._queued: list[tuple[float, bool]] = []  # one-row steps observed, not yet taken

    def observe(self, rows: int, ms: float, drafting: bool = True) -> None:
        """A pass of `rows` rows took `ms`; `drafting`: a sequence in it may draft (a
        lookup-off generation's steps only follow the speed). A one-row step is
        queued and taken when the filter is next read or a wide step comes: the engine
        calls this right after a decode, when the caches hold the model's weights and
        every line of Python costs several times what it costs in a loop over the queue."""
        if rows == 1 and ms > 0:
            self._queued.append((ms, drafting))
            if len(self._queued) >= self.QUEUE_AT_MOST:
                self._take_queued()
            return
        self._take_queued()
        self._take(rows, ms, drafting)

    def _take_queued(self) -> None:
        for ms, drafting in self._queued:
            self._take(1, ms, drafting)
        self._queued.clear()

    def _take(self, rows: int, ms: float, drafting: bool) -> None:
        if ms <= 0 or rows > self.MAX_ROWS:
            return
        if drafting:
            self._unaged += 1
        if rows > 1 or self._unaged >= self.AGE_EVERY:
            self._settle()
            self._age()
        self._cov[0, 0] += self.SPEED_DRIFT * ms
        if rows > 1:
            self._update(rows - 1, ms)
        else:
            self._one_row(ms)
        self._steps += 1
        self._prices = None

    def _clipped(self, surprise: float, spread: float) -> tuple[float, float]:
        """The surprise the update takes, and the variance the speed gains at once: a step
        more than SPIKE sds off is taken as that surprising, but a second one the same way
        is the speed that changed (another program started or stopped), taken whole."""
        bound = self.SPIKE * math.sqrt(spread)
        outlier = 0 if abs(surprise) <= bound else 1 if surprise > 0 else -1
        if outlier and outlier == self._last_outlier or not self._steps:
            self._last_outlier = 0
            return surprise, surprise * surprise
        self._last_outlier = outlier
        return (outlier * bound if outlier else surprise), 0.0

    def _update(self, shape: int, ms: float) -> None:
        """The filter's update by a step whose log time is the speed plus state `shape`'s
        log shape. The engine's steps come here for shape >= 1 (wide steps); shape 0,
        the speed alone, is the whole-state form of a one-row step that _one_row must
        equal (tests/test_step_cost.py holds them to each other)."""
        cov = self._cov
        link = cov[:, 0] + cov[:, shape] if shape else cov[:, 0].copy()  # each state's covariance with it
        spread = float(link[0] + (link[shape] if shape else 0.0)) + self.JITTER ** 2
        surprise, jump = self._clipped(math.log(ms) - float(self._mean[0] + (self._mean[shape] if shape else 0.0)), spread)
        cov[0, 0] += jump
        link[0] += jump
        spread += jump
        self._mean += link * (surprise / spread)
        cov -= np.outer(link, link) / spread  # exactly symmetric: a_i * a_j == a_j * a_i

    def _one_row(self, ms: float) -> None:
        """_update(0, ms) in O(1): a one-row step's link to the shape is the speed's
        covariance with it, cov[1:, 0], which every such step only scales. So a run of
        one-row steps moves the shape's mean along that one vector and takes a multiple of
        its outer product from the shape's covariance, and the 64x64 update (23 us from
        cache, ~125 us right after a decode) waits for a wide step, a fading or a price.
        The speed's own entries are updated here, as _update would."""
        cov, mean = self._cov, self._mean
        if not self._folding:
            self._u[:] = cov[1:, 0]
        speed_var = float(cov[0, 0])
        spread = speed_var + self.JITTER ** 2
        surprise, jump = self._clipped(math.log(ms) - float(mean[0]), spread)
        speed_var += jump
        spread += jump
        gain = surprise / spread
        mean[0] += speed_var * gain
        cov[0, 0] = speed_var - speed_var * speed_var / spread
        self._delta += self._a * gain
        self._beta += self._a * self._a / spread
        self._a *= 1.0 - speed_var / spread
        self._folding += 1
        if self._folding >= self.FOLD_AT_MOST:
            self._settle()

    def _settle(self) -> None:
        """Fold the one-row steps held by _one_row into the shape's mean and covariance."""
        if not self._folding:
            return
        u, cov = self._u, self._cov
        cross = self._a * u
        cov[1:, 0] = cross
        cov[0, 1:] = cross
        cov[1:, 1:] -= self._beta * np.outer(u, u)
        self._mean[1:] += self._delta * u
        self._a, self._beta, self._delta = 1.0, 0.0, 0.0
        self._folding = 0

    def _shape_prices(self) -> list[float]:
        """Each width's price over a one-row step: the optimistic end of its log shape."""
        u = self._u if self._folding else 0.0
        mean = self._mean[1:] + self._delta * u
        var = np.diagonal(self._cov)[1:] - self._beta * u * u
        sd = np.sqrt(np.maximum(var, 0.0))
        # no width costs less than one row, however optimistic
        return [1.0, 1.0] + np.maximum(np.exp(mean - self.OPTIMISM * sd), 1.0).tolist()

    def _age(self) -> None:
        """The shape's drift over the drafting steps since the last call: each step moves
        every width's estimate back toward the prior by 1/STALE_STEPS (mean and
        covariance alike), so what was learned fades unless it is measured again."""
        if not self._unaged:
            return
        keep = (1.0 - 1.0 / self.STALE_STEPS) ** self._unaged
        self._unaged = 0
        shape = self._mean[1:]
        shape[:] = self._prior_shape + keep * (shape - self._prior_shape)
        cov = self._cov
        cov[1:, 1:] = keep * keep * cov[1:, 1:] + (1.0 - keep * keep) * self._prior_cov
        cov[0, 1:] *= keep
        cov[1:, 0] *= keep

    def one_row_ms(self) -> float | None:
        """The one-row step's time now, as the filter follows it (None before any step)."""
        self._take_queued()
        return math.exp(self._mean[0]) if self._steps else None

    def ratio(self, rows: int, prior_per_row: float) -> float:
        """A `rows`-row step's price over a one-row step's; past MAX_ROWS, extended by
        `prior_per_row` a row."""
        if rows <= 1:
            return 1.0
        return self.ratios(rows, prior_per_row)[rows]

    def ratios(self, most: int, prior_per_row: float) -> list[float]:
        """`ratio` of every width at once: index r holds r rows' price, for r in 0..most.
        A draft is priced at every length it could take (up to 48), so one list read
        in a loop of arithmetic replaces that many calls (SmolLM2's poem after code edits:
        327 -> 219 us a token outside decode with lookup on)."""
        self._take_queued()
        if self._prices is None:
            self._prices = self._shape_prices()
        if most <= self.MAX_ROWS:
            return self._prices[: most + 1]
        top = self._prices[self.MAX_ROWS]
        return self._prices + [top + prior_per_row * (r - self.MAX_ROWS) for r in range(self.MAX_ROWS + 1, most + 1)]
