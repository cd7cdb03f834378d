"""Test-wide settings: no persistent XLA cache or param cache outside the test's own temp folders."""

import os
import tempfile

os.environ.setdefault("JAXPAGED_COMPILE_CACHE", "")  # the suite compiles fresh; one test checks the cache
os.environ.setdefault("JAXPAGED_CACHE", tempfile.mkdtemp(prefix="jaxpaged-test-cache-"))
