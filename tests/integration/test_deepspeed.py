"""The deepspeed trainer backend end to end: real Ray, real vLLM rollout workers, the HF parity
model under DeepSpeed ZeRO-2 on 2 data-parallel ranks (gloo).

- The quickstart (GRPO + LoRA) on `trainer.backend=deepspeed`: every step reports
  parity/bitwise_equal_fraction == 1.0 (rollout vs trainer log-probs, torch.equal) and every
  worker holds the trainer's adapter bytes (the checksum hook raises otherwise).
- Resume: the run's step-2 checkpoint (DeepSpeed's ZeRO partitions of both ranks + the peft
  adapter), copied into a fresh run dir and resumed to step 4 with `--resume`, gives the
  uninterrupted run's steps 3 and 4 and final adapter bit for bit.
- `kimi-rl parity check --trainer deepspeed`: bitwise on tiny Llama in bf16 with the run's
  trained adapter under ZeRO-3 (parameters gathered per module). The four Llama / Qwen3 x
  fp32 / bf16 cases re-score test_parity.py's vLLM samples (no engine of their own).
- Bad deepspeed settings fail before Ray starts, naming the file, line and key.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl.cli import main
from rl.config import load_config
from rl.loop import train
from rl.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
TIMING = ("time/", "sync/seconds")  # wall-clock values: everything else must repeat exactly
SMALL = ["logging.wandb=disabled", "logging.console=false", "logging.plot=false",
         "data.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_tokens=6",
         "trainer.backend=deepspeed", "trainer.deepspeed.zero_stage=2", "trainer.deepspeed.ranks=2"]


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))


def _strip(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(TIMING)}


@pytest.fixture(scope="module")
def straight(model_factory, tmp_path_factory):
    """4 uninterrupted quickstart steps on the deepspeed backend, a checkpoint every 2."""
    run_dir = tmp_path_factory.mktemp("ds") / "straight"
    cfg = load_config(QUICKSTART, [f"model.path={model_factory('llama')}", f"run_dir={run_dir}",
                                   *SMALL, "total_steps=4", "checkpoint.every=2"])
    train(cfg)
    return run_dir


def test_quickstart_on_deepspeed_keeps_bitwise_parity(straight):
    records = read_metrics(straight)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert r["parity/tokens"] > 0
        assert r["parity/bitwise_equal_fraction"] == 1.0, r
        assert r["parity/max_abs_diff"] == r["parity/kl_k1"] == 0.0
        assert r["sync/checksum_ok"] == 1.0
    assert any(r["ppo/grad_norm"] > 0 for r in records)  # the policy really trained
    b = [t for k, t in _adapter(straight).items() if "lora_B" in k]
    assert b and any(t.abs().max() > 0 for t in b), "the adapter did not change (B is still 0)"
    engine = straight / "checkpoints" / "step_000004" / "deepspeed" / "deepspeed"
    assert sorted(p.name for p in engine.glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def test_resume_on_deepspeed_is_bitwise(straight, model_factory, tmp_path):
    """Steps 3-4 resumed from the step-2 checkpoint == steps 3-4 of the uninterrupted run."""
    split = tmp_path / "split"
    (split / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step_000002", split / "checkpoints" / "step_000002")
    (split / "checkpoints" / "latest").write_text("step_000002\n")
    lines = (straight / "metrics.jsonl").read_text().splitlines(keepends=True)
    (split / "metrics.jsonl").write_text("".join(lines[:2]))
    assert main(["train", str(QUICKSTART), f"model.path={model_factory('llama')}", f"run_dir={split}",
                 *SMALL, "total_steps=4", "--resume", str(split)]) == 0
    a, b = read_metrics(straight), read_metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [_strip(r) for r in a] == [_strip(r) for r in b]
    assert a[2]["ppo/grad_norm"] != a[3]["ppo/grad_norm"]  # the steps really differ
    ad_a, ad_b = _adapter(straight), _adapter(split)
    assert ad_a.keys() == ad_b.keys()
    assert all(torch.equal(ad_a[k], ad_b[k]) for k in ad_a)


def test_parity_check_cli_with_the_deepspeed_trainer(straight, model_factory, tmp_path):
    """`kimi-rl parity check --trainer deepspeed` end to end, in its hardest setting: bf16, the
    adapter the quickstart run trained (peft on the HF model, cast to bf16 by DeepSpeed's bf16
    mode on one side and by the checker on vLLM's), ZeRO-3 (parameters gathered per module).
    Llama and Qwen3 in fp32 and bf16 without an adapter: tests/integration/test_parity.py."""
    report = tmp_path / "report"
    code = main(["parity", "check", "--model", model_factory("llama", "bf16"), "--dtype", "bf16",
                 "--trainer", "deepspeed", "--zero-stage", "3", "--num-prompts", "3",
                 "--max-tokens", "6", "--batch-sizes", "1,3", "--report", str(report),
                 "--adapter", str(straight / "checkpoints" / "step_000004" / "adapter")])
    result = json.loads((report / "report.json").read_text())
    assert result["trainer"] == "deepspeed" and result["adapter"]
    assert result["tokens_compared"] > 0
    assert result["bitwise_equal_fraction"] == 1.0 and result["passed"]
    assert code == 0


@pytest.mark.parametrize("setting,json_text,words", [
    ("trainer.deepspeed.zero_stage: 4", None, ["trainer.deepspeed.zero_stage", "<= 3"]),
    ("trainer.deepspeed.config: {ds}", '{\n  "zero_optimization": {"stage": 2,}\n}\n',
     ["trainer.deepspeed.config", "ds.json:2", "invalid JSON"]),
    ("trainer.deepspeed.config: {ds}", '{"optimizer": {"type": "Adam"}}',
     ["trainer.deepspeed.config", "'optimizer'", "trainer.lr"]),
])
def test_bad_deepspeed_settings_fail_before_ray(model_factory, tmp_path, capsys, setting, json_text, words):
    import ray

    ds = tmp_path / "ds.json"
    if json_text is not None:
        ds.write_text(json_text)
    key, value = setting.split(": ")
    section, sub, leaf = key.split(".")
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(f"run_dir: {tmp_path / 'r'}\ntotal_steps: 2\nmodel:\n  path: {model_factory('llama')}\n"
                   f"{section}:\n  backend: deepspeed\n  {sub}:\n    {leaf}: {value.format(ds=ds)}\n")
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"{cfg}:8" in err
    for w in words:
        assert w in err
    assert not ray.is_initialized()
    assert not (tmp_path / "r").exists()


def test_every_rank_gets_as_many_micro_batches():
    """ZeRO reduces inside backward, so every rank must run as many micro-batches, none empty;
    together they cover the minibatch once, in order, none above micro_batch_size where the
    rows allow it; one rank alone runs trainer.step's own micro-batches."""
    from types import SimpleNamespace

    from trainer.deepspeed.policy import DeepSpeedPolicyTrainer
    from trainer.step import chunks as step_chunks

    for n in (1, 2, 3):
        for size in range(n, 21):
            for mbs in (1, 3, 8):
                rows = list(range(100, 100 + size))
                shares = [DeepSpeedPolicyTrainer._micro_batches(SimpleNamespace(
                    config=SimpleNamespace(micro_batch_size=mbs), world_size=n, rank=r), rows)
                    for r in range(n)]
                assert len({len(s) for s in shares}) == 1
                chunks = [c for i in range(len(shares[0])) for c in (s[i] for s in shares)]
                assert [r for c in chunks for r in c] == rows
                assert all(len(c) >= 1 for c in chunks)
                needed = -(-size // mbs)  # micro-batches of at most mbs rows
                if -(-needed // n) * n <= size:  # as many on every rank, none empty: possible
                    assert all(len(c) <= mbs for c in chunks)
                if n == 1:
                    assert shares[0] == step_chunks(rows, mbs)
