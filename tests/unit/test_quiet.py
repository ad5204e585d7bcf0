"""rl/quiet.py: which lines the filters drop and which they keep, and `install` in a fresh
process (so its warnings filters and environment do not leak into this one)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rl import quiet

ROOT = Path(__file__).resolve().parents[2]

# One real line per LOG_NOISE entry, as the libraries print them (kimi-rl demo, parity check).
REAL_NOISE = [
    ("DeepSpeed", "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."),
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend. Disabling Triton."),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected on x86 CPUs."),
    ("vllm.platforms.cpu", "Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'."),
    ("vllm.config.vllm", "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup."),
    ("vllm.config.vllm", "Inductor compilation was disabled by user settings, optimizations settings ..."),
    ("vllm.config.vllm", "Model Runner V2 requires Triton; using the V1 model runner instead."),
    ("vllm.engine.arg_utils", "The global random seed is set to 0. Since VLLM_ENABLE_V1_MULTIPROCESSING ..."),
    ("vllm.v1.worker.cpu_worker", "libtcmalloc is not found in LD_PRELOAD. For best performance, please ..."),
    ("vllm.v1.worker.cpu_worker", "libiomp is not found in LD_PRELOAD. For best performance, please ..."),
    ("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it."),
    ("vllm.utils.torch_utils", "OMP_NUM_THREADS=2 is set; leaving Torch threads at 2 for serving."),
    ("vllm.utils.ompmultiprocessing", "VLLM_CPU_NUM_OF_RESERVED_CPU is less than the minimum requirement: 1 cores"),
    ("vllm.platforms.interface", "Padding mamba page size by 173% to ensure that mamba page size and ..."),
]


def test_every_listed_pattern_matches_a_real_line():
    for name, pattern in quiet.LOG_NOISE:
        assert any(quiet.is_noise(n, m) and n == name and re.search(pattern, m)
                   for n, m in REAL_NOISE), (name, pattern)
    assert all(quiet.is_noise(n, m) for n, m in REAL_NOISE)


@pytest.mark.parametrize(("name", "message"), [
    # The same text from another library's logger is not ours to hide.
    ("transformers", "Enforce eager set, disabling torch.compile"),
    # Other messages of a listed logger pass.
    ("vllm.config.vllm", "max_num_batched_tokens (64) is smaller than max_model_len (512)"),
    ("vllm.v1.worker.cpu_worker", "out of memory"),
    # A listed message must start where the pattern says.
    ("vllm.engine.arg_utils", "Warning: The global random seed is set to 0"),
    ("rl.loop", "step 3 skipped (policy unchanged): 8 non-finite reward(s)"),
])
def test_other_lines_pass(name, message):
    assert not quiet.is_noise(name, message)


def test_the_filter_on_a_logger_and_its_children():
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    parent = logging.getLogger("vllm.v1.worker.cpu_worker")
    child = logging.getLogger("vllm.v1.worker.cpu_worker.sub")
    handler = Keep()
    parent.addHandler(handler)
    parent.addFilter(f := quiet.NoiseFilter())
    handler.addFilter(quiet.NoiseFilter())  # records of a child reach only the handler's filter
    try:
        parent.warning("libtcmalloc is not found in LD_PRELOAD. For best performance")
        child.warning("libiomp is not found in LD_PRELOAD. For best performance")
        parent.error("engine died")
        child.warning("a real warning")
    finally:
        parent.removeHandler(handler)
        parent.removeFilter(f)
    assert records == ["engine died", "a real warning"]


def test_pythonwarnings_entries_are_literal_and_appended_once():
    for _, message in quiet.WARNING_NOISE:
        assert "," not in message and ":" not in message
    once = quiet.pythonwarnings("error::DeprecationWarning")
    assert once.startswith("error::DeprecationWarning,ignore:")
    assert quiet.pythonwarnings(once) == once


_PROBE = """
import logging, os, sys, warnings
from rl import quiet
quiet.install("--verbose" in sys.argv)
logging.basicConfig(format="%(name)s: %(message)s")
warnings.warn("`torch.distributed.reduce_op` is deprecated, please use ReduceOp", FutureWarning)
warnings.warn("a warning of our own", UserWarning)
logging.getLogger("vllm.config.vllm").warning("Enforce eager set, disabling torch.compile")
logging.getLogger("vllm.config.vllm").error("a vLLM error")
print(os.environ.get("PYTHONWARNINGS", ""), os.environ.get("TORCH_CPP_LOG_LEVEL", ""),
      os.environ.get("VLLM_LOGGING_CONFIG_PATH", ""), os.environ.get("KIMI_RL_VERBOSE", ""), sep="|")
"""


def _probe(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PYTHONWARNINGS", "TORCH_CPP_LOG_LEVEL", "VLLM_LOGGING_CONFIG_PATH", "KIMI_RL_VERBOSE")}
    return subprocess.run([sys.executable, "-c", _PROBE, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**clean, "PYTHONPATH": str(ROOT), **env}, timeout=60, check=True)


def test_install_hides_the_listed_lines_and_keeps_the_rest():
    done = _probe()
    assert "reduce_op" not in done.stderr and "Enforce eager" not in done.stderr
    assert "a warning of our own" in done.stderr and "a vLLM error" in done.stderr
    pythonwarnings, cpp_level, config_path, verbose = done.stdout.strip().split("|")
    assert "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning" in pythonwarnings
    assert cpp_level == "ERROR" and Path(config_path).is_file() and verbose == ""


@pytest.mark.parametrize("how", ["flag", "env"])
def test_verbose_hides_nothing(how):
    done = _probe("--verbose") if how == "flag" else _probe(KIMI_RL_VERBOSE="1")
    assert "reduce_op" in done.stderr and "Enforce eager set" in done.stderr
    assert done.stdout.strip() == "|||1"


@pytest.mark.parametrize("inherited", ["ours", "users"])
def test_ray_worker_on_another_node_writes_its_own_vllm_logging_config(tmp_path, inherited):
    # The driver's path names a file on the driver's host; a user's own path is left alone.
    name = "kimi-rl-vllm-logging-0-0123456789abcdef.json" if inherited == "ours" else "mine.json"
    driver_path = str(tmp_path / "driver-host" / name)
    (tmp_path / "here").mkdir()
    probe = "import os; from rl import quiet; quiet.setup_worker(); print(os.environ['VLLM_LOGGING_CONFIG_PATH'])"
    clean = {k: v for k, v in os.environ.items() if k not in ("KIMI_RL_VERBOSE", "VLLM_CONFIGURE_LOGGING")}
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=True, env={**clean, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path / "here"),
                                           "VLLM_LOGGING_CONFIG_PATH": driver_path})
    path = Path(done.stdout.strip())
    if inherited == "ours":
        assert path.parent == tmp_path / "here" and path.is_file()
    else:
        assert str(path) == driver_path
