"""rl.sandbox: model-written Python runs in a subprocess that is stopped and reported, never
trusted: an infinite loop, an unbounded allocation, a huge print, a write outside its
directory and a socket are each stopped, and nothing outside the sandbox directory changes."""

from __future__ import annotations

import os
import socket
import time

import pytest

from rl.sandbox import Limits, network_isolation, run_python

LIMITS = Limits(timeout_s=5.0, cpu_s=1, memory_mb=256, output_bytes=1000)


def _snapshot(path):
    return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*"))


def test_a_plain_program_runs():
    result = run_python("print(sum(range(10)))", LIMITS)
    assert result.ok and result.output == "45\n" and result.error is None


def test_infinite_loop_is_stopped():
    t0 = time.monotonic()
    result = run_python("while True:\n    pass\n", LIMITS)
    assert not result.ok and "CPU time limit" in result.error
    assert time.monotonic() - t0 < LIMITS.timeout_s


def test_sleeping_forever_hits_the_wall_clock():
    result = run_python("import time\ntime.sleep(60)\n", Limits(timeout_s=1.0))
    assert not result.ok and result.error == "timed out after 1 s"


def test_unbounded_allocation_is_stopped():
    result = run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))\n", LIMITS)
    assert not result.ok and "MemoryError" in result.error


@pytest.mark.parametrize("code", ["print('x' * 10**9)", "while True:\n    print('spam')\n"])
def test_huge_print_is_cut(code):
    result = run_python(code, LIMITS)
    assert not result.ok
    assert "output exceeded 1000 bytes" in result.error or "MemoryError" in result.error
    assert len(result.output) <= LIMITS.output_bytes


def test_writes_outside_the_directory_are_refused(tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("original")
    before = _snapshot(tmp_path)
    attempts = [
        f"open({str(tmp_path / 'new.txt')!r}, 'w').write('x')",
        f"open({str(keep)!r}, 'a').write('x')",
        f"import os\nos.remove({str(keep)!r})",
        f"import os\nos.rename({str(keep)!r}, 'stolen.txt')",
        f"import os\nos.mkdir({str(tmp_path / 'd')!r})",
        f"import os\nos.symlink({str(keep)!r}, 'link')\nopen('link', 'w').write('x')",
        "import os\nos.chdir('..')\nopen('escaped.txt', 'w').write('x')",
        "open('../escaped.txt', 'w').write('x')",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
        "import subprocess\nsubprocess.run(['touch', '/tmp/kimi-rl-escaped'])",
        "import ctypes",
    ]
    for code in attempts:
        result = run_python(code, LIMITS)
        assert not result.ok and "PermissionError: sandbox:" in result.error, (code, result)
    assert _snapshot(tmp_path) == before and keep.read_text() == "original"
    assert not os.path.exists("/tmp/kimi-rl-escaped")


def test_writes_inside_the_directory_work_and_vanish():
    result = run_python("import os\nopen('a.txt', 'w').write('hi')\nos.mkdir('d')\n"
                        "print(open('a.txt').read(), os.getcwd())", LIMITS)
    assert result.ok, result
    text, cwd = result.output.split()
    assert text == "hi" and not os.path.exists(cwd)  # the working directory is removed


def test_a_socket_is_refused():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'hi')"
        result = run_python(code, LIMITS)
        assert not result.ok and "PermissionError: sandbox:" in result.error
        with pytest.raises(TimeoutError):
            server.accept()  # nothing reached the listener


def test_network_isolation_is_known():
    assert network_isolation() in ("netns", "userns", "guard")


def test_the_limits_cannot_be_raised_from_inside():
    code = "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (1000, 1000))\nwhile True:\n    pass\n"
    result = run_python(code, LIMITS)
    assert not result.ok and "PermissionError: sandbox: resource.setrlimit is not allowed" in result.error


def test_closing_its_output_does_not_escape_the_clock():
    result = run_python("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)\n", Limits(timeout_s=1.0))
    assert not result.ok and result.error == "timed out after 1 s"


def test_many_quick_programs_all_succeed():
    # A program that exits right after its output is not mistaken for a killed one.
    results = [run_python(f"print({i})", LIMITS) for i in range(20)]
    assert [(r.ok, r.output, r.error) for r in results] == [(True, f"{i}\n", None) for i in range(20)]
