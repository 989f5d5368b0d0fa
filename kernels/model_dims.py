"""The model shapes the kernel calibration measures with (``kernels.calibration``), apart so
that the calibration and its workloads (``kernels.calibration_workloads``) both import it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelDims:
    """The shapes the ops see: enough to build representative inputs."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int = 1

    @property
    def linear_shapes(self) -> tuple[tuple[int, int], ...]:
        """(in, out) of one layer's matmuls: fused qkv, o, fused gate_up, down."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return ((self.hidden_size, q + 2 * kv), (q, self.hidden_size),
                (self.hidden_size, 2 * self.intermediate_size), (self.intermediate_size, self.hidden_size))
