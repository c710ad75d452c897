"""The adaptive token budget: a controller that picks each step's token budget from measured step latency, and
the glue that applies it to an engine after every step. Plain Python (no torch); unit tests drive the controller
with synthetic latencies."""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from flashvlm.server.tiers import Tier, TierConfig, load_tiers

if TYPE_CHECKING:
    from flashvlm.engine.engine import Engine

__all__ = ["AdaptiveBudgetController", "BudgetController", "BudgetSteering", "adaptive_budget"]

logger = logging.getLogger(__name__)


def _percentile(values: Iterable[float], pct: float) -> float:
    """Nearest-rank percentile: with a 32-step window P99 is the maximum, the conservative reading."""
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100.0 * len(ordered)))
    return ordered[rank - 1]


class AdaptiveBudgetController:
    """Steers the per-step token budget (max_num_batched_tokens) from measured step latency.

    Why the target is TPOT: every running request receives one token per engine step, so a step's duration is
    the inter-token latency of every request in the batch at once. Decode work per step is nearly fixed (one
    token per running sequence); what the budget changes is how many prefill tokens (chunked prefill of newly
    admitted prompts) ride along, and those inflate the step. A large budget admits prompts fast (good TTFT,
    throughput) and a small one keeps steps short (good TPOT), so the controller looks for the largest budget
    whose step latency still meets the tightest TPOT target among the tiers that are running. TTFT is the
    scheduler's business (tier priority, preemption), and it benefits from the largest budget this allows.

    Rule (AIMD, as TCP's congestion window, which converges instead of oscillating): over a sliding window of
    steps that carried decode sequences, take the P99 step latency; above `shrink_above` x target halve the
    budget, below `grow_below` x target add `grow_step` tokens, in between hold. The band between the two
    thresholds is the hysteresis: prefill cost is roughly linear in the budget, so a halving from 1.5x lands
    near 0.75x, inside the band, rather than just under the trigger. After any change the window restarts and
    `cooldown_steps` must pass, so each decision is made on latencies measured under the current budget.

    The budget stays in [min_budget, max_budget] and never below the number of decoding sequences plus
    `min_prefill_tokens` (capped at max_budget): a budget smaller than the batch would starve running requests of
    their next token, and one with no room for prefill would stop admitting anyone, so under overload every queue
    (gold's too) would grow without bound. Measured on the H200 with the 7B config: without that
    allowance the budget fell to the batch size under a 40 req/s overload and gold waited 9 s for a first token.
    A max_budget at or below decode count + min_prefill_tokens therefore pins the budget at max_budget.
    Not thread-safe: call from the engine's step loop.
    """

    def __init__(self, initial_budget: int, min_budget: int, max_budget: int, tiers: TierConfig | None = None, *,
                 window: int = 32, min_samples: int = 8, cooldown_steps: int = 8, percentile: float = 99.0,
                 shrink_above: float = 1.5, grow_below: float = 0.7, shrink_factor: float = 0.5,
                 grow_step: int = 256, min_prefill_tokens: int = 512) -> None:
        if not 1 <= min_budget <= max_budget:
            raise ValueError(f"need 1 <= min_budget <= max_budget, got {min_budget}, {max_budget}")
        if not 0 < grow_below < shrink_above:
            raise ValueError(f"need 0 < grow_below < shrink_above, got {grow_below}, {shrink_above}")
        if not 0 < shrink_factor < 1 or grow_step < 1:
            raise ValueError("need 0 < shrink_factor < 1 and grow_step >= 1")
        if not 1 <= min_samples <= window:
            raise ValueError(f"need 1 <= min_samples <= window, got {min_samples}, {window}")
        if min_prefill_tokens < 0:
            raise ValueError(f"min_prefill_tokens must be >= 0, got {min_prefill_tokens}")
        self.min_prefill_tokens = min_prefill_tokens
        self.tiers = tiers if tiers is not None else load_tiers(None)
        self.min_budget = min_budget
        self.max_budget = max_budget
        self.min_samples = min_samples
        self.cooldown_steps = cooldown_steps
        self.percentile = percentile
        self.shrink_above = shrink_above
        self.grow_below = grow_below
        self.shrink_factor = shrink_factor
        self.grow_step = grow_step
        self._budget = min(max(initial_budget, min_budget), max_budget)
        self._window: collections.deque[float] = collections.deque(maxlen=window)
        self._steps_since_change = cooldown_steps  # the first decision needs only min_samples
        self.last_p99_s: float | None = None
        self.last_target_s: float | None = None

    @property
    def budget(self) -> int:
        return self._budget

    def update(self, step_latency_s: float, num_decode_seqs: int, active_tiers: Iterable[str | Tier]) -> int:
        """Feed one finished step; returns the budget for the next one. `active_tiers`: tiers with requests in
        the running batch (names or Tiers; an unknown name raises ValueError, since admission validated them)."""
        self._steps_since_change += 1
        floor = max(self.min_budget, min(num_decode_seqs + self.min_prefill_tokens, self.max_budget))
        self._budget = max(self._budget, floor)
        target = self.tiers.tightest_tpot_s(active_tiers)
        self.last_target_s = target
        # A step with no decoding sequence delays nobody's next token; its latency says nothing about TPOT.
        if num_decode_seqs <= 0 or target is None:
            return self._budget
        self._window.append(step_latency_s)
        if len(self._window) < self.min_samples or self._steps_since_change < self.cooldown_steps:
            return self._budget
        p99 = _percentile(self._window, self.percentile)
        self.last_p99_s = p99
        new = self._budget
        if p99 > self.shrink_above * target:
            new = max(floor, int(self._budget * self.shrink_factor))
        elif p99 < self.grow_below * target:
            new = min(self.max_budget, self._budget + self.grow_step)
        if new != self._budget:
            self._budget = new
            self._window.clear()
            self._steps_since_change = 0
        return self._budget


class BudgetController(Protocol):
    """What BudgetSteering drives: AdaptiveBudgetController, or a test's fixed answer."""

    def update(self, step_latency_s: float, num_decode_seqs: int, active_tiers: Iterable[str | Tier]) -> int: ...


class BudgetSteering:
    """Applies a budget controller to an engine. `after_step` is AsyncEngine's `on_step` hook: on the engine
    thread, after each step, it feeds the controller the step's latency, its decode count and the tiers in the
    running batch, and sets the engine's token budget to the answer.

    The budget set is never below min(max_num_seqs, max_num_batched_tokens), so a full batch of decodes always
    fits; `Engine.set_token_budget` keeps it at most max_num_batched_tokens (activation memory and CUDA graphs
    were sized for that). A controller that raises is switched off and the configured budget restored: a
    controller bug must not take the engine down, it serves on at the fixed budget."""

    def __init__(self, engine: Engine, controller: BudgetController) -> None:
        self.engine = engine
        self.controller: BudgetController | None = controller
        sched = engine.config.scheduler
        self._configured = sched.max_num_batched_tokens
        self._floor = min(sched.max_num_seqs, self._configured)
        if engine.step_log is None:
            # The controller needs each step's decode count; a one-slot log keeps that at no memory cost.
            engine.step_log = collections.deque(maxlen=1)  # type: ignore[assignment]

    def after_step(self, step_latency_s: float) -> None:
        if self.controller is None:
            return
        engine = self.engine
        log = engine.step_log
        num_decode = log[-1].num_decode_tokens if log else 0
        try:
            budget = int(self.controller.update(step_latency_s, num_decode, engine.running_groups()))
        except Exception:
            logger.exception("the token budget controller failed; it is switched off")
            self.controller = None
            engine.set_token_budget(self._configured)
            return
        engine.set_token_budget(max(self._floor, budget))


def adaptive_budget(engine: Engine, tiers: TierConfig) -> BudgetSteering:
    """The server's adaptive budget: an AdaptiveBudgetController between min(max_num_seqs, budget) and the
    configured max_num_batched_tokens, starting at the latter, steering the engine by the tiers' TPOT targets."""
    sched = engine.config.scheduler
    budget = sched.max_num_batched_tokens
    return BudgetSteering(engine, AdaptiveBudgetController(budget, min(sched.max_num_seqs, budget), budget, tiers))
