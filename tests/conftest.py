"""Test setup: glibc's malloc tuned as every command tunes it (`fedjax_split.runtime`: importing
the library no longer does), 2 forced CPU devices (to test sharding), strict dtype promotion,
fp32 matmuls, and one XLA compilation cache for the whole session, subprocesses included (the CLI
tests compile the very programs the in-process tests compiled already)."""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="fedjax-split-xla-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

from fedjax_split import runtime  # noqa: E402

runtime.tune_malloc()  # before JAX starts its threads, as the commands do

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
