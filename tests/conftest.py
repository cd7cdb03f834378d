"""Test-wide settings: no persistent XLA cache or param cache outside the test's own temp folders."""

import os
import tempfile

os.environ.setdefault("JAXPAGED_COMPILE_CACHE", "")  # the suite compiles fresh; one test checks the cache
os.environ.setdefault("JAXPAGED_CACHE", tempfile.mkdtemp(prefix="jaxpaged-test-cache-"))


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _unfrozen_heap():
    """``LLMEngine.warmup()`` freezes the heap (``jaxpaged.heap``): each test starts and ends unfrozen, so one
    test's warm-up does not keep another's cyclic garbage alive."""
    yield
    gc.unfreeze()
