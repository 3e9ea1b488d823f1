"""How long an engine step takes, as a function of the tokens it computes: t = a + b * tokens.

Fitted online by least squares over the most recent steps (a window, so the model follows the
machine as it warms up and drifts). Until two different token counts have been seen the
prior holds. Used by the MLFQ batcher: q_1 = predict(1) (the minimal iteration), a prompt's
prefill time = predict(prompt tokens)."""

from __future__ import annotations

from collections import deque


class StepTimeModel:
    def __init__(self, prior_a: float = 0.02, prior_b: float = 5e-4, window: int = 256) -> None:
        self.a, self.b, self.prior_b = prior_a, prior_b, prior_b
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._sums = [0.0, 0.0, 0.0, 0.0]  # x, y, xx, xy over the window (kept as it slides)
        self._until_exact = window

    def observe(self, tokens: int, seconds: float) -> None:
        """A step that computed `tokens` tokens (prefill chunks + decodes) in `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        sums = self._sums
        if len(self.samples) == self.samples.maxlen:
            x, y = self.samples[0]
            sums[0] -= x
            sums[1] -= y
            sums[2] -= x * x
            sums[3] -= x * y
        self.samples.append((tokens, seconds))
        sums[0] += tokens
        sums[1] += seconds
        sums[2] += tokens * tokens
        sums[3] += tokens * seconds
        self._until_exact -= 1
        if self._until_exact <= 0:  # summed afresh once a window: no drift from the updates
            self._until_exact = self.samples.maxlen
            sums[:] = [
                sum(x for x, _ in self.samples),
                sum(y for _, y in self.samples),
                sum(x * x for x, _ in self.samples),
                sum(x * y for x, y in self.samples),
            ]
        self._fit()

    def predict(self, tokens: int) -> float:
        return self.a + self.b * max(tokens, 1)

    def _fit(self) -> None:
        """Least squares over the window (running sums: O(1) a step, the simulator steps
        millions of times)."""
        n = len(self.samples)
        sx, sy, sxx, sxy = self._sums
        den = n * sxx - sx * sx
        if den <= 0:  # one token count so far: keep the prior's slope (at most half the mean)
            mx, my = sx / n, sy / n
            self.b = min(self.prior_b, 0.5 * my / mx)
            self.a = my - self.b * mx
            return
        b = (n * sxy - sx * sy) / den
        a = (sy - b * sx) / n
        if b <= 0:  # noise: time does not fall with more tokens
            b, a = 0.0, sy / n
        self.a, self.b = max(a, 1e-6), b
