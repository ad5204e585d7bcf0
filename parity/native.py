"""Builds and loads the compiled parity kernels (parity/csrc/*.cpp) as `torch.ops.kimi_parity`.

Built with torch's extension machinery on first use (or ahead of time by scripts/setup.sh:
`python -m parity.native`), into a directory named by the sources' hash inside the virtualenv
(`<venv>/kimi-rl-ext/`; `parity/csrc/build/` outside a venv), never the home directory, so a
fresh machine builds from the repository's own files and an edit to a source rebuilds. One
portable build: the kernels pick AVX-512, AVX2 or scalar code at run time, and every choice
computes the same bits (parity/csrc/gemm.cpp and elementwise.cpp say why).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path

import torch

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("gemm.cpp", "elementwise.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / "isa.h"]  # hashed with the sources, not compiled
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
    """torch.ops.kimi_parity, building the library first if this source version has no build."""
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


if __name__ == "__main__":
    ops()
    print(f"parity kernels built in {build_directory()}")
