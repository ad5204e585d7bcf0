"""scripts/bench_table.py: the benchmarks table is made from the bench_parity JSON files, between
its markers, and a file it cannot read is named in a one-line error."""

from __future__ import annotations

import json

import pytest

from scripts.bench_table import END, START, regenerate

RUN = {
    "label": "smoke, loaded machine", "date": "2026-12-06", "commit": "abc1234", "cpu": "Some CPU",
    "kernel_isa": "avx2", "threads": 2, "loadavg_1m": [3.0, 4.5],
    "results": [{"model": "tiny", "dtype": "fp32", "what": "rollout tokens/s", "baseline": "stock vLLM, eager",
                 "stock": 100.0, "parity": 50.0, "slowdown": 2.0, "target": 1.1, "shape": "grpo",
                 "sequences": 64, "max_tokens": 8, "repeats": 5}],
    "gemm": [{"m": 16, "n": 256, "k": 128, "dtype": "bfloat16", "threads": 1, "mkl_gflops": 10.0,
              "parity_gflops": 8.0, "ratio": 0.8, "weight": "prepacked", "target": 0.7}],
}


def test_the_table_is_rewritten_between_the_markers(tmp_path):
    runs = tmp_path / "bench"
    runs.mkdir()
    (runs / "parity-tiny-grpo-abc1234.json").write_text(json.dumps(RUN))
    page = tmp_path / "benchmarks.md"
    page.write_text(f"intro\n{START}\n| stale |\n{END}\noutro\n")
    text = regenerate(page, runs)
    assert text.startswith(f"intro\n{START}\n| run |") and text.endswith(f"{END}\noutro\n")
    assert "| stale |" not in text
    rows = [line for line in text.splitlines() if line.startswith("| [abc1234]")]
    assert len(rows) == 2 and all(row.count("|") == 13 for row in rows)
    assert "| tiny fp32 | rollout tokens/s (stock vLLM, eager) | grpo, 64 seqs x 8 tokens | 100.000 | 50.000 | 2.00× |" in rows[0]
    assert "| GEMM bfloat16 |" in rows[1] and "| 0.80 of MKL |" in rows[1]


def test_bad_files_are_named(tmp_path):
    runs = tmp_path / "bench"
    runs.mkdir()
    page = tmp_path / "benchmarks.md"
    page.write_text("no markers\n")
    with pytest.raises(SystemExit, match="benchmarks.md: the bench_table markers are missing"):
        regenerate(page, runs)
    page.write_text(f"{START}\n{END}\n")
    (runs / "parity-broken.json").write_text(json.dumps({k: v for k, v in RUN.items() if k != "threads"}))
    with pytest.raises(SystemExit, match=r"parity-broken.json: missing field 'threads'"):
        regenerate(page, runs)
