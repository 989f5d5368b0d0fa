"""Whether to load cached blocks from a lower tier or recompute their tokens: measured, not assumed.

    load_us(n)      = n * load_us_per_block                 # from the loads this engine timed
    recompute_us(n) = n * block_size * 1e6 / prefill_tok_s  # from the prefill steps it timed

Both start from a default (``LoadCostDefaults``) and follow an exponential moving average of
what is observed, so a slow host (or a lower tier behind a network) stops being loaded from as
soon as it is measured to cost more than the forward pass it would save. The decision is per
block (both costs are linear), so it is all or nothing for one admission.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoadCostDefaults:
    """Estimates before the first measurement. Loads: a 737 KB SmolLM2 block copies in 30-250 us
    on the 2-core dev CPU (see ``copy_block_runs``). Prefill: the engine measured 200-300 tok/s
    there with the cores shared; a GPU is far faster at both, and the measurements take over
    after the first load and the first prefill step."""

    load_us_per_block: float = 200.0
    prefill_tok_s: float = 300.0
    smoothing: float = 0.25  # weight of a new observation in the moving averages


class LoadCostModel:
    """Measured load and recompute costs of one tier (units: microseconds, tokens/second)."""

    def __init__(self, block_size: int, defaults: LoadCostDefaults = LoadCostDefaults()) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.load_us_per_block = defaults.load_us_per_block
        self.prefill_tok_s = defaults.prefill_tok_s
        self._alpha = defaults.smoothing

    @property
    def recompute_us_per_block(self) -> float:
        return self.block_size * 1e6 / self.prefill_tok_s

    def should_load(self, num_blocks: int) -> bool:
        """Whether loading ``num_blocks`` is estimated faster than recomputing their tokens."""
        return num_blocks > 0 and self.load_us_per_block < self.recompute_us_per_block

    def observe_load(self, num_blocks: int, seconds: float) -> None:
        """A load of ``num_blocks`` took ``seconds`` (wall time, copies included)."""
        if num_blocks > 0 and seconds >= 0:
            sample = seconds * 1e6 / num_blocks
            self.load_us_per_block += self._alpha * (sample - self.load_us_per_block)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A forward pass computed ``num_tokens`` prompt tokens in ``seconds``."""
        if num_tokens > 0 and seconds > 0:
            sample = num_tokens / seconds
            self.prefill_tok_s += self._alpha * (sample - self.prefill_tok_s)
