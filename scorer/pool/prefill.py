"""How long a prompt takes to prefill, fitted from what the data path observes.

The router counts a request as prefilling until the engine says prefill is over. For a
stream whose response body reaches us that is the first body chunk (the first token;
vLLM sends a stream's headers before prefill ends, so headers are too early). A
non-streaming request says nothing until its whole generation is done (vLLM sends its
headers at the end), and a stream whose body Envoy does not send us has only its early
headers: for those the prefill end is estimated with this model.

    seconds = a + b x uncached prompt tokens

fitted by least squares over the last observations (routed → first body chunk of
streams, with the uncached tokens the decision predicted), with exponential forgetting so
it follows the fleet's current speed. Until `min_samples` observations exist, the
defaults hold (a = 20 ms, b = 0.1 ms per token: a GPU-class prefill rate of ~10k
tokens/s; conservative for CPU engines, which the fit then corrects). Estimates are
clamped to [min_s, max_s].

The scrape corrects the estimate (`scrape_correction`, applied by the director for every
new metrics page of a worker): vLLM's `vllm:num_requests_running` + `_waiting` count every
request the engine holds, so when a page counts fewer than the requests we have prefilling
there that the page must have seen, the surplus has left the engine and the oldest of them
end prefill now; and while the newest page shows W waiting requests, the W newest of ours
there are held in prefill past their estimate (vLLM queues first come, first served).

`running` counts decoding requests too, so that correction alone ends a request's prefill
only once it has *finished*: in the lean Envoy shape (no response body to the scorer) a
request stayed "prefilling" for its whole estimate, up to 10x its real prefill against
fast engines (issue 13: the phantom queue moved conversations off their workers). vLLM's
counters say exactly how many requests it holds before their first token (`before_first`,
scorer.pool.scrape: running + waiting + finished - first tokens, the TTFT histogram's
count), so the correction ends our oldest seen flights beyond that many, a page or two
after their first token, whatever the engine's speed.

The same counts teach the model where nothing else does (`load.fit_prefill_from_scrapes`;
the lean shape sends no response body; scorer.director `_fit_from_pages`): a page's
`before_first` holds the newest that many of our requests there, so each older one had
its first token after the last page that held it and before this one.
`bracketed_prefill` turns that bracket into one observation (its middle), so the
estimate, not the next pages, ends the following requests' prefill near the engine's
real speed. Response bodies are exact: once one has taught the model, brackets are no
longer taken (`PrefillModel.exact`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefillModel:
    """Online least-squares fit of prefill seconds against uncached prompt tokens."""

    a: float = 0.02  # seconds of fixed cost (scheduling, first step)
    b: float = 1e-4  # seconds per uncached prompt token
    decay: float = 0.98  # weight kept by older observations at each new one
    min_samples: int = 8
    min_s: float = 0.001
    max_s: float = 60.0
    # Exponentially weighted sums for the fit.
    _n: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0
    samples: int = 0
    exact: int = 0  # observations from response bodies (the first token itself)
    bracketed: int = 0  # observations from the scrape correction (bracketed_prefill)

    def observe(self, tokens: float, seconds: float, exact: bool = True) -> None:
        """One prefill: `tokens` uncached prompt tokens took `seconds` to the first token.

        `exact`: seen at the first token itself (a response body); False: bracketed by
        two metrics pages (counted in `bracketed`).
        """
        if seconds <= 0.0 or tokens < 0.0 or seconds > self.max_s:
            return
        d = self.decay
        self._n = self._n * d + 1.0
        self._sx = self._sx * d + tokens
        self._sy = self._sy * d + seconds
        self._sxx = self._sxx * d + tokens * tokens
        self._sxy = self._sxy * d + tokens * seconds
        self.samples += 1
        if exact:
            self.exact += 1
        else:
            self.bracketed += 1
        if self.samples < self.min_samples:
            return
        den = self._n * self._sxx - self._sx * self._sx
        if den <= 1e-9 * max(self._n * self._sxx, 1.0):
            # All prompts the same size: keep the slope, refit the intercept.
            if self.exact == 0 and self._sy < self.b * self._sx:
                self._rate()  # faster than the slope alone says: the slope is wrong
                return
            self.a = max(self._sy / self._n - self.b * self._sx / self._n, 0.0)
            return
        b = (self._n * self._sxy - self._sx * self._sy) / den
        a = (self._sy - b * self._sx) / self._n
        if b >= 0.0:
            self.b = b
            self.a = max(a, 0.0)
        elif self.exact == 0:
            # Brackets are a scrape interval wide: against fast engines that noise hides
            # the slope. Fall back to the mean rate rather than keep the default.
            self._rate()

    def _rate(self) -> None:
        """The line through the origin with the observations' mean seconds per token."""
        if self._sx > 0.0:
            self.a, self.b = 0.0, self._sy / self._sx

    def estimate(self, tokens: float) -> float:
        """Expected prefill seconds for `tokens` uncached prompt tokens."""
        # max / min spelled out (same results, NaN included: the first argument unless
        # the second is strictly larger / smaller); the builtins parse keyword arguments
        # on every call (~700 instructions each). Once per decision.
        s = self.a + self.b * (0.0 if tokens < 0.0 else tokens)
        lo = self.min_s
        s = lo if lo > s else s
        hi = self.max_s
        return hi if hi < s else s

    def view(self) -> dict[str, float | int]:
        """The fit as `/debug/pool` shows it (ms; the defaults until `min_samples`)."""
        return {
            "fixed_ms": round(self.a * 1e3, 3),
            "ms_per_token": round(self.b * 1e3, 6),
            "samples": self.samples,
            "exact": self.exact,
            "bracketed": self.bracketed,
        }


# A routed request reaches the engine within this long (Envoy's hop; the benchmark's
# client → engine p50 is ~25 ms wall): a page younger than that may not count it yet.
ARRIVAL_S = 0.05


def bracketed_prefill(routed_at: float, page_at: float, last_held_at: float | None) -> float:
    """Seconds one request's prefill took, from the page that showed it over.

    The engine reached its first token before `page_at` and after `last_held_at` (an
    earlier page that still counted it before its first token; None or before the
    routing: no such page, so any time after `routed_at`). Returns the middle of that
    interval, from `routed_at`: one scrape interval of error at most, half on average,
    against an estimate that can be 10x off (issue 13).
    """
    lo = routed_at if last_held_at is None else max(last_held_at, routed_at)
    return max((lo + page_at) / 2.0 - routed_at, 0.0)


def scrape_correction(
    seen: int,
    prefilling: int,
    running: float,
    waiting: float,
    before_first: float | None = None,
) -> tuple[int, int]:
    """What a fresh metrics page says about one worker's requests we count as prefilling.

    `prefilling`: our requests on the worker still counted as prefilling, oldest first;
    `seen`: how many of the oldest were routed before the page was requested (so the
    engine held them, unless they had finished). Returns `(end, hold)`: end the `end`
    oldest now (the engine holds fewer requests than that many of ours before their
    first token: the surplus is done with prefill), and do not end the `hold` newest of
    the rest by the estimate alone (the engine says that many wait in its queue).

    `before_first`: the requests the engine holds that have not had their first token
    (`ScrapedLoad.before_first`, from its counters); None: every request it holds
    (running + waiting) may still be in prefill.
    """
    held = max(int(running + waiting if before_first is None else before_first), 0)
    end = min(max(seen - held, 0), prefilling)
    hold = min(max(int(waiting), 0), prefilling - end)
    return end, hold
