"""Write a parity check's report: report.json, two PNG plots and an HTML page."""

from __future__ import annotations

import html
import json
import os
import tempfile
from pathlib import Path

import torch


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _plots(report_dir: Path, diffs: list[torch.Tensor], title: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    width = max((d.numel() for d in diffs), default=0)
    by_pos = torch.zeros(width)
    for d in diffs:
        by_pos[: d.numel()] = torch.maximum(by_pos[: d.numel()], d)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(range(width), by_pos.tolist(), marker=".", lw=1)
    ax.set_xlabel("response position")
    ax.set_ylabel("max |Δ logp| over sequences")
    ax.set_title(f"{title}: |rollout − trainer| by position")
    fig.tight_layout()
    fig.savefig(report_dir / "abs_diff_by_position.png", dpi=110)
    plt.close(fig)
    names.append("abs_diff_by_position.png")

    flat = torch.cat(diffs) if diffs else torch.zeros(0)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    nonzero = flat[flat > 0]
    zeros = int((flat == 0).sum())
    if nonzero.numel():
        bins = torch.logspace(float(nonzero.min().log10()), float(nonzero.max().log10()) + 1e-9, 40)
        ax.hist(nonzero.tolist(), bins=bins.tolist())
        ax.set_xscale("log")
        ax.set_xlabel("|Δ logp| (non-zero tokens, log scale)")
    else:
        ax.text(0.5, 0.5, "every token bit-identical (|Δ logp| = 0)", ha="center", va="center")
        ax.set_xticks([])
    ax.set_ylabel("tokens")
    ax.set_title(f"{title}: {zeros} of {flat.numel()} tokens exactly equal")
    fig.tight_layout()
    fig.savefig(report_dir / "abs_diff_histogram.png", dpi=110)
    plt.close(fig)
    names.append("abs_diff_histogram.png")
    return names


def write_report(report_dir: str | Path, report: dict, diffs: list[torch.Tensor]) -> Path:
    """report: the JSON-able summary; diffs: per-sequence |rollout - trainer| tensors."""
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(report_dir / "report.json", (json.dumps(report, indent=2) + "\n").encode())
    verdict = "PASS: bit-identical" if report["tokens_equal"] == report["tokens_compared"] else "MISMATCH"
    title = f"parity {report['parity']} · {report['dtype']}"
    images = _plots(report_dir, diffs, title)
    rows = "".join(
        f"<tr><td>{html.escape(str(bs))}</td><td>{s['tokens_compared']}</td>"
        f"<td>{s['bitwise_equal_fraction']:.6f}</td><td>{s['max_abs_diff']:.3e}</td>"
        f"<td>{s['mean_abs_diff']:.3e}</td><td>{s['kl_k1']:.3e}</td><td>{s['kl_k3']:.3e}</td></tr>"
        for bs, s in report["per_batch_size"].items()
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>kimi-rl parity report</title>
<style>body{{font-family:sans-serif;max-width:900px;margin:2em auto}}td,th{{padding:4px 10px;text-align:right}}
table{{border-collapse:collapse}}tr:nth-child(even){{background:#f3f3f3}}</style></head><body>
<h1>kimi-rl parity check: {html.escape(verdict)}</h1>
<p>model <code>{html.escape(str(report['model']))}</code>, dtype {report['dtype']}, parity {report['parity']},
{report['tokens_compared']} sampled tokens compared (rollout log-prob from vLLM vs trainer log-prob from Megatron).</p>
<table><tr><th>batch size</th><th>tokens</th><th>bitwise equal</th><th>max |Δ|</th><th>mean |Δ|</th><th>KL k1</th><th>KL k3</th></tr>
{rows}</table>
{''.join(f'<p><img src="{name}" alt="{name}"></p>' for name in images)}
</body></html>
"""
    _atomic_write(report_dir / "index.html", page.encode())
    return report_dir
