"""Layout-invariant training (`trainer.deterministic_layout`) on the Megatron backend: three PPO
steps (LoRA policy, LoRA critic + value head, KL and entropy terms, two minibatches a step)
from one fixed batch give the same bits at every (data_parallel_size, tensor_parallel_size) of
(1, 1), (2, 1), (1, 2) and (2, 2), with micro-batch size 1 and 4, padded and packed: the SHA-256
of every trainable tensor and every optimizer tensor, and every metric, are equal on every rank,
and each data-parallel rank trains its share of tokens (> 0). A run continues bitwise on another
layout: 2 steps at (DP 2, TP 1), a checkpoint, 2 steps at (DP 1, TP 2) are 4 steps at (1, 1).
The ordered step is also the plain step's math: its first step's losses equal the plain path's
to rounding (the plain path's bits do depend on the micro-batch size).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rl.config import AlgorithmConfig, LoraConfig, TrainerConfig

# The recorded batch: 8 sequences of ragged lengths, groups of 2, built once here.
_G = torch.Generator().manual_seed(0)
SEQS = [torch.randint(3, 400, (n,), generator=_G).tolist() for n in (20, 25, 18, 30, 14, 27, 22, 16)]
STARTS = [8, 10, 8, 12, 6, 9, 11, 5]
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
STEPS = 3
LAYOUT_KEY = "train/rank_tokens/"  # each rank's share: the one stat that depends on the layout


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def _trainer(path: str, dp: int, micro: int, deterministic: bool = True, tp: int = 1, packed: bool = False):
    from trainer.megatron.policy import PolicyTrainer

    return PolicyTrainer(
        path, "fp32", True, LoraConfig(enabled=True),
        TrainerConfig(lr=1e-2, micro_batch_size=micro, data_parallel_size=dp, tensor_parallel_size=tp,
                      deterministic_layout=deterministic, packed_sequences=packed),
        AlgorithmConfig(name="ppo", minibatches=2, kl_coef=0.05, entropy_coef=0.01), seed=0,
    )


def _steps(trainer, n: int) -> list[dict]:
    from trainer.step import Batch

    stats = []
    for _ in range(n):
        lp = trainer.logprobs(SEQS, STARTS)
        stats.append(trainer.train_step(Batch(SEQS, STARTS, lp, REWARDS, group_size=2)))
    return stats


def _hashes(trainer) -> dict[str, str]:
    """SHA-256 of every trainable tensor (policy and critic) and every optimizer tensor."""
    state = trainer.state_dict()
    hashes = {f"{part}.{k}": _sha(v) for part in ("policy", "critic") for k, v in state[part].items()}
    for i, s in state["optimizer"]["state"].items():
        hashes.update({f"optimizer.{i}.{k}": _sha(v) for k, v in s.items() if torch.is_tensor(v)})
    return hashes


def _train(path: str, dp: int, micro: int, deterministic: bool = True, tp: int = 1, packed: bool = False,
           more: int = 0) -> dict:
    """STEPS PPO steps at this layout; the hashes of the state and the stats of every step, and
    with `more`, those of `more` steps after them ("later")."""
    trainer = _trainer(path, dp, micro, deterministic, tp, packed)
    stats = _steps(trainer, STEPS)
    moved = sum(int(v.abs().sum() > 0) for v in trainer.state_dict()["critic"].values())
    run = {"hashes": _hashes(trainer), "stats": stats, "moved": moved}
    if more:
        run["later"] = {"stats": _steps(trainer, more), "hashes": _hashes(trainer)}
    return run


# Each spawned world's layouts (micro-batch size, packed): between them and the reference world
# of one, every (DP, TP) runs micro-batch 1 padded and 4 packed, (1, 1) also 4 padded and 1 packed.
WORLD_LAYOUTS = ((1, False), (4, True))
SAVED = 2  # the steps before the checkpoint that a world of TP 2 resumes from


def _rank(rank: int, size: int, tp: int, rendezvous: str, path: str, out: str, checkpoint: str) -> None:
    """One process of a world of `size` ranks, `tp` per TP group: that world's layouts. At TP 1
    it also trains SAVED steps at micro-batch 4 and rank 0 writes their checkpoint there; at
    TP 2 and DP 1 every rank resumes from it for SAVED more steps ("resumed")."""
    from trainer.checkpoint import load_checkpoint, save_checkpoint, step_dir_name
    from trainer.megatron.patches import init_megatron
    from trainer.megatron.worker import init_world

    torch.set_num_threads(1)
    init_world(rank, size, rendezvous)
    init_megatron(tp_size=tp, seed=0)
    dp = size // tp
    runs = {f"dp{dp}-tp{tp}-mb{micro}{'-packed' * packed}": _train(path, dp, micro, True, tp, packed)
            for micro, packed in WORLD_LAYOUTS}
    if tp == 1:
        trainer = _trainer(path, dp, 4)
        _steps(trainer, SAVED)
        if rank == 0:
            save_checkpoint(Path(checkpoint), SAVED, trainer, {"step": SAVED}, keep=1)
    elif dp == 1:
        trainer = _trainer(path, dp, 4, tp=tp)
        load_checkpoint(Path(checkpoint) / "checkpoints" / step_dir_name(SAVED), trainer)
        runs["resumed"] = {"stats": _steps(trainer, SAVED), "hashes": _hashes(trainer)}
    torch.save(runs, os.path.join(out, f"rank{rank}.pt"))


def _world(path: str, tmp, size: int, tp: int) -> list[dict]:
    out = tmp / f"world{size}-tp{tp}"
    out.mkdir()
    args = (size, tp, str(out / "store"), path, str(out), str(tmp / "checkpoint"))
    mp.spawn(_rank, nprocs=size, join=True, args=args)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(size)]


@pytest.fixture(scope="module")
def runs(model_factory, tmp_path_factory, megatron) -> dict[str, dict]:
    """Every layout's run by name (a spawned world's once per rank), the plain step's
    ("plain-mb4") and the resumed run's ("resumed", per rank). Here, a world of one (torch's
    default thread count): (1, 1) at micro-batch 1 (STEPS + 1 steps: the resume's reference), 4,
    4 packed and 1 packed; then worlds of (DP, TP) = (2, 1), (1, 2) and (2, 2) on spawned ranks
    (one thread each), in that order (the second resumes from the first's checkpoint)."""
    path = model_factory("llama", "fp32")
    out = {"dp1-tp1-mb1": _train(path, 1, 1, more=SAVED * 2 - STEPS), "dp1-tp1-mb4": _train(path, 1, 4),
           "dp1-tp1-mb4-packed": _train(path, 1, 4, packed=True), "dp1-tp1-mb1-packed": _train(path, 1, 1, packed=True),
           "plain-mb4": _train(path, 1, 4, False)}
    tmp = tmp_path_factory.mktemp("trainer-dp")
    for size, tp in ((2, 1), (2, 2), (4, 2)):
        for r, ranks in enumerate(_world(path, tmp, size, tp)):
            out.update({f"rank{r}-{k}" if k != "resumed" else f"resumed-rank{r}": v for k, v in ranks.items()})
    return out


def _layouts(runs: dict[str, dict]) -> dict[str, dict]:
    return {k: v for k, v in runs.items() if not k.startswith(("plain", "resumed"))}


def test_state_hashes_are_identical_on_every_layout(runs):
    layouts = _layouts(runs)
    reference = layouts["dp1-tp1-mb1"]
    assert reference["moved"] > 0  # the critic (zero-initialised head) was trained
    assert len(reference["hashes"]) > 50  # every LoRA A/B of policy and critic, head, Adam state
    for name, run in layouts.items():
        assert run["hashes"] == reference["hashes"], name


def test_metrics_are_identical_on_every_layout(runs):
    layouts = _layouts(runs)
    reference = layouts["dp1-tp1-mb1"]["stats"]
    for name, run in layouts.items():
        for step, (ref, got) in enumerate(zip(reference, run["stats"], strict=True)):
            ref = {k: v for k, v in ref.items() if not k.startswith(LAYOUT_KEY)}
            got = {k: v for k, v in got.items() if not k.startswith(LAYOUT_KEY)}
            assert got == ref, (name, step)


def test_each_rank_trains_a_share_of_the_tokens(runs):
    data_parallel = [k for k in runs if "-dp2-" in k]
    assert len(data_parallel) == 12  # 2 + 4 ranks, 2 layouts each
    for name in data_parallel:
        for stats in runs[name]["stats"]:
            shares = [stats[f"{LAYOUT_KEY}{r}"] for r in range(2)]
            assert all(s > 0 for s in shares), (name, shares)
            # Each optimizer step's minibatch is split whole: the shares add up to its tokens.
            per_minibatch = stats["train/response_tokens"] / stats["train/optimizer_steps"]
            assert sum(shares) == pytest.approx(per_minibatch)


def test_ordered_step_is_the_plain_steps_math(runs):
    """Same loss and gradient as the plain micro-batched step, up to the summation order."""
    ordered, plain = runs["dp1-tp1-mb4"]["stats"][0], runs["plain-mb4"]["stats"][0]
    for k in ("ppo/policy_loss", "critic/value_loss", "ppo/grad_norm", "critic/grad_norm", "ppo/entropy"):
        assert ordered[k] == pytest.approx(plain[k], rel=1e-4, abs=1e-7), k
    assert runs["plain-mb4"]["hashes"] != runs["dp1-tp1-mb4"]["hashes"]  # the plain path's own bits


def test_resume_on_another_layout_continues_the_run(runs):
    """SAVED steps at (DP 2, TP 1), rank 0's checkpoint, then SAVED steps at (DP 1, TP 2) on
    both ranks: bitwise 2 * SAVED steps at (1, 1), state and metrics."""
    reference = runs["dp1-tp1-mb1"]
    later = reference["stats"][SAVED:] + reference["later"]["stats"]
    for r in range(2):
        resumed = runs[f"resumed-rank{r}"]
        assert resumed["hashes"] == reference["later"]["hashes"], r
        assert resumed["stats"] == later, r


def test_trainer_refuses_what_it_cannot_keep(model_factory, megatron, tmp_path):
    from trainer.megatron.policy import PolicyTrainer

    path = model_factory("llama", "fp32")
    with pytest.raises(ValueError, match="data_parallel_size 2 needs trainer.deterministic_layout"):
        PolicyTrainer(path, trainer=TrainerConfig(data_parallel_size=2))
    with pytest.raises(ValueError, match="needs trainer.backend megatron"):
        PolicyTrainer(path, trainer=TrainerConfig(backend="deepspeed", deterministic_layout=True))
    # This process is a world of one: two data-parallel ranks are not there to gather from.
    with pytest.raises(ValueError, match="data_parallel_size is 2, but the process group holds 1"):
        PolicyTrainer(path, trainer=TrainerConfig(data_parallel_size=2, deterministic_layout=True))
    with pytest.raises(ValueError, match="packed_sequences needs trainer.backend megatron, parity on"):
        PolicyTrainer(path, parity=False, trainer=TrainerConfig(packed_sequences=True))
    # A vocabulary the model's row_splits (2) does not divide: a rank's LM-head rows would cut
    # a slice of the gradient's order (refused before any model is built).
    odd = tmp_path / "odd-vocab"
    shutil.copytree(path, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] - 1}))
    with pytest.raises(ValueError, match=r"needs the vocabulary \(511\) divisible by the model's row_splits \(2\)"):
        PolicyTrainer(odd, lora=LoraConfig(enabled=True),
                      trainer=TrainerConfig(tensor_parallel_size=2, deterministic_layout=True))
