"""The process-wide XLA setting made at import (xla_env) and the pool sizing that follows either allocator."""

import types

import pytest

from jaxpaged import xla_env
from jaxpaged.pool_size import bfc_memory_fraction, free_device_memory


def test_skip_temp_flag_added_only_on_request_with_cuda_and_without_user_choice():
    f = xla_env.xla_flags_with_skip_temp
    assert f("", "1", cuda=True) == xla_env.SKIP_TEMP_FLAG
    assert f("--xla_dump_to=/tmp/x", "1", cuda=True) == "--xla_dump_to=/tmp/x " + xla_env.SKIP_TEMP_FLAG
    assert f("", None, cuda=True) == "" and f("", "0", cuda=True) == ""  # only on request
    assert f("", "1", cuda=False) == ""  # a CPU-only JAX never sees a GPU flag
    user = "--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE"
    assert f(user, "1", cuda=True) == user  # the user's own choice stays


def test_configure_writes_the_environment_once():
    env = {"XLA_FLAGS": "--a=1", xla_env.OPT_IN_ENV: "1"}
    assert xla_env.configure(env, cuda=True)
    assert env["XLA_FLAGS"] == "--a=1 " + xla_env.SKIP_TEMP_FLAG
    assert xla_env.configure(env, cuda=True)  # idempotent: already there
    assert env["XLA_FLAGS"].count("SKIP_TEMP") == 1
    off = {}
    assert not xla_env.configure(off, cuda=True) and "XLA_FLAGS" not in off  # the default: BFC, no flag
    assert not xla_env.configure({xla_env.OPT_IN_ENV: "1"}, cuda=False)


def test_this_process_has_no_flag_without_a_cuda_plugin_or_request():
    import os

    if not xla_env.cuda_plugin_installed() or os.environ.get(xla_env.OPT_IN_ENV) != "1":
        assert xla_env.SKIP_TEMP_FLAG not in os.environ.get("XLA_FLAGS", "")
        assert not xla_env.skip_temp_active()  # CPU: no VMM allocator


def _device(platform, stats, hw_id=0):
    return types.SimpleNamespace(platform=platform, memory_stats=lambda: stats, local_hardware_id=hw_id)


def test_free_memory_under_bfc_is_its_limit_minus_use():
    d = _device("gpu", {"bytes_limit": 100, "bytes_in_use": 30})
    assert free_device_memory(d, mem_info=lambda i: pytest.fail("BFC stats suffice")) == 70


def test_free_memory_under_vmm_leaves_what_bfc_would_leave(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    gib = 1 << 30
    seen = []

    def info(ordinal):
        seen.append(ordinal)
        return 130 * gib, 140 * gib  # 10 GiB already taken (context, weights)

    d = _device("gpu", None, hw_id=1)
    # BFC would hold 0.75 * 140 = 105 GiB of which 10 in use: 95 free; the driver's 130 less 35 outside.
    assert free_device_memory(d, mem_info=info) == 95 * gib
    assert seen == [1]
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert free_device_memory(d, mem_info=info) == 60 * gib
    assert free_device_memory(d, mem_info=lambda i: None) is None  # no driver: unknown
    assert free_device_memory(_device("cpu", None), mem_info=info) is None


def test_bfc_fraction_reads_both_names_and_ignores_bad_values(monkeypatch):
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert bfc_memory_fraction() == 0.75
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "")  # empty: unset, as JAX treats it
    assert bfc_memory_fraction() == 0.75
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    assert bfc_memory_fraction() == 0.6
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")  # the newer name wins
    assert bfc_memory_fraction() == 0.9
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "lots")
    assert bfc_memory_fraction() == 0.6


def test_skip_temp_needs_the_flag_not_only_a_stats_free_gpu(monkeypatch):
    gpu_without_stats = types.SimpleNamespace(platform="gpu", memory_stats=lambda: None)
    monkeypatch.setenv("XLA_FLAGS", "")
    assert not xla_env.skip_temp_active(gpu_without_stats)  # e.g. the platform allocator: not VMM
    monkeypatch.setenv("XLA_FLAGS", xla_env.SKIP_TEMP_FLAG)
    assert xla_env.skip_temp_active(gpu_without_stats)
    assert not xla_env.skip_temp_active(types.SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": 1}))
