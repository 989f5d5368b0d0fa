"""Adaptive speculation length: how many drafts to propose for a request this step.

Speculation pays when the batch is small (decode is memory-bound, so verifying k+1 positions
costs about as much as one) and the drafts get accepted. ``AdaptiveK`` turns it off above a
batch-size threshold and otherwise sizes k from each request's acceptance rate.

The rate is per draft token: alpha = accepted / judged, where the judged drafts of a step are
the accepted ones plus the first rejected one (drafts after it are never tested). Under the
usual i.i.d. model draft position j (0-based) is accepted with probability alpha^(j+1), so k
is the longest run whose last draft still has a chance of at least ``min_draft_accept_prob``:

    k = floor(log(min_draft_accept_prob) / log(alpha)), clamped to [0, max_k].

Drafts are not free: a draft token costs ``draft_cost`` target decode steps to produce (0 for
n-gram lookup, the drafter's share of the target's weight bytes for a model drafter, since
decode is bandwidth-bound) and ``verify_cost`` to verify (the target's extra cost per verified
position at batch 1). Verification stops being nearly free as the batch grows (the matmuls turn
compute-bound), so in a step of B requests one draft costs

    c(B) = draft_cost + verify_cost * max(1, B / verify_batch_knee).

With E(k) = 1 + alpha + ... + alpha^k tokens per step expected, k drafts pay only if
E(k) / (1 + k * c(B)) > 1, so k is further capped at the k that maximises that ratio (0 when no
k beats plain decoding): an expensive drafter on text it cannot predict switches itself off. A
drafter with c(1) >= 1 cannot pay even when every draft is accepted ((k + 1) / (1 + k c) <= 1),
so it never drafts, not even to probe.

A request whose k fell to 0 proposes ``probe_k`` drafts every ``probe_interval`` steps so a
change in the text (a quoted passage starts) can bring speculation back; with costly drafts the
interval stretches so probing costs at most ``max_probe_overhead`` of plain decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveKConfig:
    """Policy knobs.

    ``batch_size_threshold``: at or above this many running requests no request speculates.
    The default 32 is a placeholder until the loadtests benchmark measures where verifying
    k+1 positions stops being nearly free on the target hardware.
    ``ema_weight``: weight of the newest step in the acceptance-rate moving average.
    """

    max_k: int = 4
    batch_size_threshold: int = 32
    ema_weight: float = 0.3
    initial_acceptance_rate: float = 0.7
    min_draft_accept_prob: float = 0.3
    probe_interval: int = 16
    probe_k: int = 1
    draft_cost: float = 0.0
    verify_cost: float = 0.0
    verify_batch_knee: float = 3.0
    max_probe_overhead: float = 0.02

    def __post_init__(self) -> None:
        if self.max_k < 0:
            raise ValueError(f"AdaptiveKConfig.max_k must be >= 0, got {self.max_k}")
        if self.batch_size_threshold < 1:
            raise ValueError(
                f"AdaptiveKConfig.batch_size_threshold must be >= 1, got {self.batch_size_threshold}")
        if not 0.0 < self.ema_weight <= 1.0:
            raise ValueError(f"AdaptiveKConfig.ema_weight must be in (0, 1], got {self.ema_weight}")
        if not 0.0 <= self.initial_acceptance_rate <= 1.0:
            raise ValueError(f"AdaptiveKConfig.initial_acceptance_rate must be in [0, 1], "
                             f"got {self.initial_acceptance_rate}")
        if not 0.0 < self.min_draft_accept_prob < 1.0:
            raise ValueError(
                f"AdaptiveKConfig.min_draft_accept_prob must be in (0, 1), got {self.min_draft_accept_prob}")
        for name in ("draft_cost", "verify_cost"):
            if not 0.0 <= getattr(self, name) < math.inf:
                raise ValueError(f"AdaptiveKConfig.{name} must be finite and >= 0, got {getattr(self, name)}")
        if not 1.0 <= self.verify_batch_knee < math.inf:
            raise ValueError(f"AdaptiveKConfig.verify_batch_knee must be >= 1, got {self.verify_batch_knee}")
        if not 0.0 < self.max_probe_overhead <= 1.0:
            raise ValueError(
                f"AdaptiveKConfig.max_probe_overhead must be in (0, 1], got {self.max_probe_overhead}")
        if self.probe_interval < 1 or not 0 <= self.probe_k <= self.max_k:
            raise ValueError(
                f"AdaptiveKConfig needs probe_interval >= 1 and 0 <= probe_k <= max_k, "
                f"got probe_interval={self.probe_interval}, probe_k={self.probe_k}")


@dataclass(slots=True)
class _RequestState:
    acceptance_rate: float
    num_idle_steps: int = 0  # consecutive next_k calls that returned 0 for low acceptance


class AdaptiveK:
    """Per-request k from a moving acceptance rate, plus global per-position statistics."""

    def __init__(self, config: AdaptiveKConfig | None = None) -> None:
        self.config = config or AdaptiveKConfig()
        self.can_pay = self.cost_per_draft(1) < 1.0
        self._requests: dict[str, _RequestState] = {}
        self.num_proposed_per_position: list[int] = [0] * self.config.max_k  # drafts at position j
        self.num_accepted_per_position: list[int] = [0] * self.config.max_k  # of those, accepted
        self.num_spec_steps = 0  # record() calls with at least one draft
        self.num_accepted_total = 0

    def next_k(self, request_id: str, batch_size: int) -> int:
        """Drafts to propose for ``request_id`` in a step running ``batch_size`` requests."""
        cfg = self.config
        if batch_size >= cfg.batch_size_threshold or not self.can_pay:
            return 0
        state = self._state(request_id)
        k = self._k_for_rate(state.acceptance_rate, batch_size)
        if k > 0:
            state.num_idle_steps = 0
            return k
        state.num_idle_steps += 1
        if state.num_idle_steps >= self.probe_interval(batch_size):
            state.num_idle_steps = 0
            return cfg.probe_k
        return 0

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """Account one verification step: ``num_accepted`` of ``num_proposed`` drafts accepted."""
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"need 0 <= num_accepted <= num_proposed, got {num_accepted}, {num_proposed}")
        if num_proposed == 0:
            return
        state = self._state(request_id)
        num_judged = num_accepted + (num_accepted < num_proposed)
        w = self.config.ema_weight
        state.acceptance_rate = (1.0 - w) * state.acceptance_rate + w * (num_accepted / num_judged)

        grow = num_proposed - len(self.num_proposed_per_position)
        if grow > 0:
            self.num_proposed_per_position.extend([0] * grow)
            self.num_accepted_per_position.extend([0] * grow)
        for j in range(num_proposed):
            self.num_proposed_per_position[j] += 1
        for j in range(num_accepted):
            self.num_accepted_per_position[j] += 1
        self.num_spec_steps += 1
        self.num_accepted_total += num_accepted

    def remove(self, request_id: str) -> None:
        """Forget a finished or aborted request (statistics keep its counts)."""
        self._requests.pop(request_id, None)

    def acceptance_rate(self, request_id: str) -> float:
        """The request's current moving per-draft acceptance rate."""
        return self._state(request_id).acceptance_rate

    @property
    def mean_accepted_length(self) -> float:
        """Mean accepted drafts per verification step that had drafts (0.0 before any)."""
        return self.num_accepted_total / self.num_spec_steps if self.num_spec_steps else 0.0

    def _state(self, request_id: str) -> _RequestState:
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestState(self.config.initial_acceptance_rate)
        return state

    def cost_per_draft(self, batch_size: int) -> float:
        """One draft's cost in target decode steps, in a step running ``batch_size`` requests."""
        cfg = self.config
        return cfg.draft_cost + cfg.verify_cost * max(1.0, batch_size / cfg.verify_batch_knee)

    def probe_interval(self, batch_size: int) -> int:
        """Idle steps between probes: at least ``probe_interval``, more where a probe costs more
        than ``max_probe_overhead`` of that many plain steps."""
        cfg = self.config
        probe_cost = cfg.probe_k * self.cost_per_draft(batch_size)
        return max(cfg.probe_interval, math.ceil(probe_cost / cfg.max_probe_overhead - 1e-9))

    def _k_for_rate(self, rate: float, batch_size: int) -> int:
        cfg = self.config
        if rate <= 0.0:
            return 0
        k = cfg.max_k if rate >= 1.0 else math.floor(
            math.log(cfg.min_draft_accept_prob) / math.log(rate) + 1e-9)
        k = max(0, min(cfg.max_k, k))
        cost_per_draft = self.cost_per_draft(batch_size)
        if cost_per_draft == 0.0 or k == 0:
            return k
        # the k <= the rate rule's k that gives the most tokens per unit of target time
        best_k, best_gain, expected = 0, 1.0, 1.0
        for j in range(1, k + 1):
            expected += min(rate, 1.0) ** j
            gain = expected / (1.0 + j * cost_per_draft)
            if gain > best_gain:
                best_k, best_gain = j, gain
        return best_k
