"""StepTuning: how the engine shapes and compiles its steps, the internal choices a benchmark may vary.

These are not user settings: their defaults are the measured winners on each device kind
(docs/DECISIONS.md), and ``EngineConfig`` does not carry them. A benchmark that studies one of them
passes ``LLMEngine(..., tuning=StepTuning(...))``.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class StepTuning:
    """min_token_bucket: a step's tokens are padded to a power of two of at least this many (one
      compiled step per size). A GPU uses 1 (a batch-1 step computes one row in every projection,
      at the cost of four more shapes to compile); a CPU 16 (compilation, not padding, dominates
      there).
    step_executables: copies of each compiled step of at most ``copies_max_tokens`` tokens, launched
      in turn, so each copy's CUDA graph finds the two token buffers where its previous launch left
      them and XLA patches no graph node before the launch. 2 on a GPU, 1 elsewhere (a CPU has no
      CUDA graphs) and with tensor parallelism.
    cublas_max_tokens: steps of more than 32 and at most this many padded tokens (decode-sized) compile
      XLA's GEMMs as cuBLAS calls instead of Triton fusions (faster there; cuBLAS for prefill-sized
      steps made the whole workload slower). 512 on a GPU, 0 on a CPU and with ``batch_invariant``
      (whose matmuls are Pallas kernels).
    copies_max_tokens: the largest padded step that uses every copy (``step_executables``).
    """

    min_token_bucket: int
    step_executables: int
    cublas_max_tokens: int
    copies_max_tokens: int = 32

    def __post_init__(self) -> None:
        m = self.min_token_bucket
        if not isinstance(m, int) or m < 1 or m & (m - 1):
            raise ValueError(f"min_token_bucket must be a power of two >= 1, got {m!r}")
        if self.step_executables < 1:
            raise ValueError(f"step_executables must be >= 1, got {self.step_executables!r}")
        if self.cublas_max_tokens < 0:
            raise ValueError(f"cublas_max_tokens must be >= 0, got {self.cublas_max_tokens!r}")

    @classmethod
    def default(cls, batch_invariant: bool = False) -> StepTuning:
        """The measured defaults for this process's device kind."""
        if jax.default_backend() == "gpu":
            return cls(min_token_bucket=1, step_executables=2, cublas_max_tokens=0 if batch_invariant else 512)
        return cls(min_token_bucket=16, step_executables=1, cublas_max_tokens=0)

