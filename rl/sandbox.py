"""The `python` tool's sandbox: model-written code in a subprocess, with limits, never in the
driver's process.

What stops what (each is a separate layer; `run_python` reports a stopped program as an error):

    no network      a fresh network namespace (unshare(CLONE_NEWNET) as root, else a user +
                    network namespace); where the kernel allows neither (e.g. a container
                    whose seccomp profile refuses unshare), the guard below still refuses to
                    create sockets. `network_isolation()` says which one this machine has.
    CPU             RLIMIT_CPU (the kernel kills the program) and a wall-clock timeout (its
                    whole process group is killed)
    memory          RLIMIT_AS: an unbounded allocation raises MemoryError inside the program
    output          at most `output_bytes` are read; more kills the program
    files           a temporary working directory, removed afterwards; RLIMIT_FSIZE caps a
                    file's size. Writes, deletes, renames and mkdirs outside that directory
                    are refused by the guard: a Python audit hook (PEP 578) installed before the
                    code runs, which also refuses new processes, ctypes and the introspection
                    that could reach the hook. This is a Python-level barrier, not a kernel
                    one: for code from an adversarial model, run the workers in a container.
"""

from __future__ import annotations

import functools
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass


@dataclass
class Limits:
    timeout_s: float = 5.0  # wall clock
    cpu_s: int = 2
    memory_mb: int = 512  # address space: the interpreter itself needs ~30 MB
    output_bytes: int = 4096
    file_bytes: int = 1 << 20


@dataclass
class SandboxResult:
    ok: bool
    output: str  # what the program printed (stdout and stderr), at most output_bytes
    error: str | None = None  # why it failed or was stopped


# Run by the sandboxed interpreter (python -I -c _GUARD network cpu_s memory file_bytes): its
# own limits and network namespace first (in the child itself, so the driver, which may have
# threads, never runs code between fork and exec), then the guard, then the code in main.py.
_GUARD = r'''
import os, sys

def _isolate(network, cpu, memory, file_bytes):
    import ctypes, resource
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    flags = {"netns": 0x40000000, "userns": 0x10000000 | 0x40000000}.get(network)
    libc = ctypes.CDLL(None, use_errno=True)
    if flags is not None and libc.unshare(flags) != 0:
        sys.exit(f"sandbox: unshare failed (errno {ctypes.get_errno()})")
    for name in ("ctypes", "_ctypes"):  # imported for unshare only: the code must import it anew
        sys.modules.pop(name, None)

_isolate(sys.argv[1], *map(int, sys.argv[2:5]))
del _isolate

def _make_hook(root, realpath, fsdecode, sep):
    # Everything the hook reads is in this closure: the code cannot reach it to change it.
    write = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    paths = frozenset({"os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.truncate", "os.chmod",
                       "os.chown", "os.utime", "os.link", "os.symlink", "shutil.rmtree", "os.chdir",
                       "os.chflags"})
    denied = frozenset({"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                        "os.fork", "os.forkpty", "pty.spawn", "os.kill", "os.killpg", "ctypes.dlopen",
                        "ctypes.cdata", "socket.__new__", "socket.connect", "socket.bind",
                        "socket.getaddrinfo", "gc.get_objects", "gc.get_referrers",
                        "gc.get_referents", "sys._current_frames", "code.__new__", "function.__new__",
                        "resource.setrlimit", "resource.prlimit"})
    modules = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "_socket"})

    def inside(path):
        if isinstance(path, int):
            return True  # an already open descriptor
        real = realpath(fsdecode(path))
        return real == root or real.startswith(root + sep)

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in mode for c in "wax+")) or bool((flags or 0) & write)
            if writing and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing outside the working directory: {path}")
        elif event in paths:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    raise PermissionError(f"sandbox: {event} outside the working directory: {path}")
        elif event in denied or (event == "import" and args[0] in modules):
            raise PermissionError(f"sandbox: {args[0] if event == 'import' else event} is not allowed")

    return hook

sys.addaudithook(_make_hook(os.path.realpath(os.getcwd()), os.path.realpath, os.fsdecode, os.sep))
del _make_hook
with open("main.py", encoding="utf-8") as _f:
    _code = _f.read()
exec(compile(_code, "main.py", "exec"), {"__name__": "__main__"})
'''


def _command(limits: Limits, network: str) -> list[str]:
    return [sys.executable, "-I", "-c", _GUARD, network, str(limits.cpu_s), str(limits.memory_mb << 20),
            str(limits.file_bytes)]


@functools.lru_cache(maxsize=1)
def network_isolation() -> str:
    """How this machine cuts the sandbox off the network: "netns" (a network namespace),
    "userns" (a user + network namespace, without root) or "guard" (the audit hook only),
    found by trying them in that order once."""
    with tempfile.TemporaryDirectory(prefix="kimi-rl-sandbox-") as workdir:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write("pass\n")
        for mode in ("netns", "userns"):
            done = subprocess.run(_command(Limits(), mode), cwd=workdir, capture_output=True, timeout=30)
            if done.returncode == 0:
                return mode
    return "guard"


def _read_limited(proc: subprocess.Popen, limits: Limits) -> tuple[bytes, str | None]:
    """(output, why the program was stopped or None): reads stdout until EOF, the output cap
    or the wall-clock deadline."""
    deadline = time.monotonic() + limits.timeout_s
    out = bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out), f"timed out after {limits.timeout_s:g} s"
            if not sel.select(timeout=left):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                return bytes(out), None
            out += chunk
            if len(out) > limits.output_bytes:
                return bytes(out[: limits.output_bytes]), f"output exceeded {limits.output_bytes} bytes"


def _exit_reason(code: int, limits: Limits) -> str | None:
    if code == 0:
        return None
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return f"CPU time limit ({limits.cpu_s} s) exceeded"
    if code == -signal.SIGXFSZ:
        return f"file size limit ({limits.file_bytes} bytes) exceeded"
    return f"exited with status {code}" if code > 0 else f"killed by signal {-code}"


def run_python(code: str, limits: Limits | None = None) -> SandboxResult:
    """Run `code` as a Python program in the sandbox; never raises for what the code does."""
    limits = limits or Limits()
    network = network_isolation()
    with tempfile.TemporaryDirectory(prefix="kimi-rl-sandbox-") as workdir:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        proc = subprocess.Popen(
            _command(limits, network), cwd=workdir, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            env={"PATH": "/usr/bin:/bin", "PYTHONIOENCODING": "utf-8"},
        )
        started = time.monotonic()
        try:
            output, stopped = _read_limited(proc, limits)
            if stopped is None:  # its output ended: give it the rest of its time to exit
                try:
                    proc.wait(timeout=max(limits.timeout_s - (time.monotonic() - started), 0.1))
                except subprocess.TimeoutExpired:
                    stopped = f"timed out after {limits.timeout_s:g} s"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its whole session: nothing outlives it
            proc.wait()
            proc.stdout.close()
    text = output.decode("utf-8", errors="replace")
    error = stopped or _exit_reason(proc.returncode, limits)
    if error and proc.returncode and proc.returncode > 0 and not stopped:
        error = f"{error}: {_last_line(text)}"  # the traceback's last line says what failed
    return SandboxResult(error is None, text, error)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"
