"""Builds and loads the compiled parity kernels (parity/csrc/*.cpp) as `torch.ops.kimi_parity`.

Built with torch's extension machinery on first use (or ahead of time by scripts/setup.sh:
`python -m parity.native`), into a directory named by the sources' hash inside the virtualenv
(`<venv>/kimi-rl-ext/`; `parity/csrc/build/` outside a venv), never the home directory, so a
fresh machine builds from the repository's own files and an edit to a source rebuilds. One
portable build: the kernels pick AVX-512 (with or without the bf16 dot product), AVX2 or scalar
code at run time, and every choice computes the same bits (parity/csrc/gemm.cpp,
elementwise.cpp and sampling.cpp say why).

The code path is the process's choice: `KIMI_RL_ISA=avx512_bf16|avx512|avx2|scalar` pins it (read when the
library loads; a path this CPU cannot run is refused with a one-line error), else the fastest
path of the CPU runs. `set_isa` changes it later and exports it to child processes (vLLM's
engine and workers, Ray actors). Whatever torch still computes itself follows torch's own
switch, ATEN_CPU_CAPABILITY (`isa_environment` gives both variables for a path).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path

import torch

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("gemm.cpp", "elementwise.cpp", "sampling.cpp", "rope.cpp", "attention.cpp")]
# Hashed with the sources, not compiled.
HEADERS = [Path(__file__).parent / "csrc" / name for name in ("isa.h", "fixed_math.h")]
# -ffp-contract=off: no implicit fused multiply-adds; the kernels' FMAs are all explicit.
# -fno-trapping-math / -fno-math-errno: no FP traps and no errno from sqrt, so the compiler may
# vectorise selects and square roots; neither changes a value (no reassociation, no fast-math).
CFLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno"]


def build_directory() -> Path:
    digest = hashlib.sha256()
    for src in SOURCES + HEADERS:
        digest.update(src.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(torch.__version__.encode())
    in_venv = sys.prefix != sys.base_prefix
    root = Path(sys.prefix) / "kimi-rl-ext" if in_venv else Path(__file__).parent / "csrc" / "build"
    return root / digest.hexdigest()[:16]


@functools.cache
def ops():
    """torch.ops.kimi_parity, building the library first if this source version has no build;
    KIMI_RL_ISA is checked first (a one-line ValueError, not a C++ trace, when it is bad)."""
    env = os.environ.get("KIMI_RL_ISA", "")
    if env:
        _check_isa(env, "KIMI_RL_ISA")
    library = _build()
    if env and env not in library.isas():
        raise ValueError(f"KIMI_RL_ISA={env}: this CPU cannot run that code path "
                         f"(it can run {', '.join(library.isas())})")
    return library


def _build():
    from torch.utils import cpp_extension

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    # torch runs `ninja` from PATH; a venv's ninja is next to its python even when the venv is
    # not activated (`.venv/bin/kimi-rl ...`).
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bindir, os.environ.get("PATH", "")])
    cpp_extension.load(
        name="kimi_parity_kernels", sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS,
        build_directory=str(directory), is_python_module=False, verbose=False,
    )
    return torch.ops.kimi_parity


ISAS = ("avx512_bf16", "avx512", "avx2", "scalar")
# torch's name for the same vector width (ATEN_CPU_CAPABILITY); its scalar path is "default".
_ATEN_CAPABILITY = {"avx512_bf16": "avx512", "avx512": "avx512", "avx2": "avx2", "scalar": "default"}


def _check_isa(name: str, source: str) -> None:
    if name not in ISAS:
        raise ValueError(f"{source} must be one of {', '.join(ISAS)}, got {name!r}")


def check_isa_environment() -> None:
    """A one-line ValueError when KIMI_RL_ISA names no code path, or one this CPU cannot run
    (builds the library to ask it); nothing when it is unset. For a CLI to call up front."""
    if os.environ.get("KIMI_RL_ISA"):
        ops()


def isa() -> str:
    """The code path the compiled kernels run in this process: avx512_bf16, avx512, avx2 or scalar."""
    return ops().isa()


def bf16_dot() -> str:
    """What the CPU's VDPBF16PS does here (parity/csrc/gemm.cpp): "on: ..." when it passed the
    start-up self-test and beat the same order in fp32 FMAs (avx512_bf16 is then the default
    path), else why not; and whether this process's path runs it."""
    status = ops().bf16_dot_status()
    return status if isa() == "avx512_bf16" else f"not used on code path {isa()} ({status})"


def cpu_isas() -> list[str]:
    """The code paths this CPU can run, fastest first (scalar always)."""
    return list(ops().isas())


def set_isa(name: str) -> None:
    """Run every compiled kernel of this process on `name` from now on, and hand the choice to
    the child processes started later (KIMI_RL_ISA in the environment). ValueError for a name
    that is not a path or a path this CPU cannot run."""
    _check_isa(name, "isa")
    if name not in cpu_isas():
        raise ValueError(f"isa {name}: this CPU cannot run that code path (it can run {', '.join(cpu_isas())})")
    ops().set_isa(name)
    os.environ["KIMI_RL_ISA"] = name


def isa_environment(name: str) -> dict[str, str]:
    """The environment that pins a process to code path `name`: ours and torch's."""
    _check_isa(name, "isa")
    return {"KIMI_RL_ISA": name, "ATEN_CPU_CAPABILITY": _ATEN_CAPABILITY[name]}


if __name__ == "__main__":
    ops()
    print(f"parity kernels built in {build_directory()}")
