"""Test helpers (re-exported from the package so benchmarks and tests share one implementation)."""

from jaxpaged.models.paged_forward import build_step, forward_all_logits  # noqa: F401
