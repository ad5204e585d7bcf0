"""Layout-invariant training (`trainer.deterministic_layout`) on the Megatron backend: three PPO
steps (LoRA policy, LoRA critic + value head, KL and entropy terms, two minibatches a step)
from one fixed batch give the same bits at (data_parallel_size, micro_batch_size) = (1, 1),
(1, 4), (1, 4) with packed sequences, (2, 1) and (2, 4): the SHA-256 of every trainable tensor and every optimizer tensor,
and every metric, are equal, and each rank trains its share of tokens (> 0). At
tensor_parallel_size 2, (DP, micro-batch) = (1, 4) packed and (2, 1) agree with each other on all
ranks. The ordered step is also the plain step's math: its first step's losses equal the
plain path's to rounding (the plain path's bits do depend on the micro-batch size).
"""

from __future__ import annotations

import hashlib
import os
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


def _train(path: str, dp: int, micro: int, deterministic: bool = True, tp: int = 1, packed: bool = False) -> dict:
    """STEPS PPO steps at this layout; the hashes of the state and the stats of every step."""
    trainer = _trainer(path, dp, micro, deterministic, tp, packed)
    stats = _steps(trainer, STEPS)
    moved = sum(int(v.abs().sum() > 0) for v in trainer.state_dict()["critic"].values())
    return {"hashes": _hashes(trainer), "stats": stats, "moved": moved}


def _rank(rank: int, size: int, tp: int, micros: tuple[int, ...], packed: bool, rendezvous: str, path: str,
          out: str) -> None:
    """One process of a world of `size` ranks, `tp` per TP group: that world's layouts. At
    TP 1 it also writes (rank 0) a checkpoint after STEPS - 1 steps at micro-batch 4."""
    from trainer.checkpoint import save_checkpoint
    from trainer.megatron.patches import init_megatron
    from trainer.megatron.worker import init_world

    torch.set_num_threads(1)
    init_world(rank, size, rendezvous)
    init_megatron(tp_size=tp, seed=0)
    runs = {f"dp{size // tp}-mb{micro}": _train(path, size // tp, micro, True, tp, packed) for micro in micros}
    if tp == 1:
        trainer = _trainer(path, size, 4)
        _steps(trainer, STEPS - 1)
        if rank == 0:
            save_checkpoint(Path(out), STEPS - 1, trainer, {"step": STEPS - 1}, keep=1)
    torch.save(runs, os.path.join(out, f"rank{rank}.pt"))


def _world(path: str, tmp, size: int, tp: int = 1, micros: tuple[int, ...] = (1, 4), packed: bool = False
           ) -> list[dict]:
    out = tmp / f"world{size}-tp{tp}"
    out.mkdir()
    mp.spawn(_rank, nprocs=size, join=True, args=(size, tp, micros, packed, str(out / "store"), path, str(out)))
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(size)]


@pytest.fixture(scope="module")
def runs(model_factory, tmp_path_factory, megatron):
    """(DP, micro-batch) = (1, 1), (1, 4), (1, 4) with packed sequences and the plain step here
    (a world of one, torch's default thread count), then (2, 1) and (2, 4) on 2 spawned ranks
    (one thread each)."""
    path = model_factory("llama", "fp32")
    one = {"dp1-mb1": _train(path, 1, 1, True), "dp1-mb4": _train(path, 1, 4, True),
           "dp1-mb4-packed": _train(path, 1, 4, True, packed=True), "plain-mb4": _train(path, 1, 4, False)}
    tmp = tmp_path_factory.mktemp("trainer-dp")
    rank0, rank1 = _world(path, tmp, 2)
    return one, (rank0, rank1), path, tmp / "world2-tp1"


@pytest.fixture(scope="module")
def tp_runs(model_factory, tmp_path_factory) -> list[dict]:
    """(DP, TP, micro-batch) = (1, 2, 4) with packed sequences and (2, 2, 1) padded: every rank's run."""
    path = model_factory("llama", "fp32")
    tmp = tmp_path_factory.mktemp("trainer-dp-tp")
    return [run for world in (_world(path, tmp, 2, 2, (4,), packed=True), _world(path, tmp, 4, 2, (1,)))
            for ranks in world for run in ranks.values()]


def _layouts(runs) -> dict[str, dict]:
    one, (rank0, rank1), _, _ = runs
    return {"dp1-mb1": one["dp1-mb1"], "dp1-mb4": one["dp1-mb4"], "dp1-mb4-packed": one["dp1-mb4-packed"],
            **{f"rank{r}-{k}": v for r, ranks in enumerate((rank0, rank1)) for k, v in ranks.items()}}


def test_state_hashes_are_identical_on_every_layout(runs):
    layouts = _layouts(runs)
    reference = layouts["dp1-mb1"]
    assert reference["moved"] > 0  # the critic (zero-initialised head) was trained
    assert len(reference["hashes"]) > 50  # every LoRA A/B of policy and critic, head, Adam state
    for name, run in layouts.items():
        assert run["hashes"] == reference["hashes"], name


def test_metrics_are_identical_on_every_layout(runs):
    layouts = _layouts(runs)
    reference = layouts["dp1-mb1"]["stats"]
    for name, run in layouts.items():
        for step, (ref, got) in enumerate(zip(reference, run["stats"], strict=True)):
            ref = {k: v for k, v in ref.items() if not k.startswith(LAYOUT_KEY)}
            got = {k: v for k, v in got.items() if not k.startswith(LAYOUT_KEY)}
            assert got == ref, (name, step)


def test_each_rank_trains_a_share_of_the_tokens(runs):
    _, (rank0, _), _, _ = runs
    for micro in (1, 4):
        for stats in rank0[f"dp2-mb{micro}"]["stats"]:
            shares = [stats[f"{LAYOUT_KEY}{r}"] for r in range(2)]
            assert all(s > 0 for s in shares), shares
            # Each optimizer step's minibatch is split whole: the shares add up to its tokens.
            per_minibatch = stats["train/response_tokens"] / stats["train/optimizer_steps"]
            assert sum(shares) == pytest.approx(per_minibatch)


def test_ordered_step_is_the_plain_steps_math(runs):
    """Same loss and gradient as the plain micro-batched step, up to the summation order."""
    one = runs[0]
    ordered, plain = one["dp1-mb4"]["stats"][0], one["plain-mb4"]["stats"][0]
    for k in ("ppo/policy_loss", "critic/value_loss", "ppo/grad_norm", "critic/grad_norm", "ppo/entropy"):
        assert ordered[k] == pytest.approx(plain[k], rel=1e-4, abs=1e-7), k
    assert one["plain-mb4"]["hashes"] != one["dp1-mb4"]["hashes"]  # the plain path's own bits


def test_resume_on_another_layout_continues_the_run(runs):
    """STEPS - 1 steps at (DP 2, micro-batch 4), rank 0's checkpoint, then 1 step at (DP 1,
    micro-batch 1) in this process: bitwise STEPS steps at (1, 1), state and metrics."""
    from trainer.checkpoint import load_checkpoint, step_dir_name

    one, _, path, out = runs
    trainer = _trainer(path, 1, 1)
    load_checkpoint(out / "checkpoints" / step_dir_name(STEPS - 1), trainer)
    (last,) = _steps(trainer, 1)
    assert _hashes(trainer) == one["dp1-mb1"]["hashes"]
    assert last == one["dp1-mb1"]["stats"][-1]


def test_data_parallel_composes_with_tensor_parallel(tp_runs):
    """At TP = 2, DP 1 or 2, any micro-batch size, padded or packed give the same bits on every rank. (Not
    TP = 1's bits: the TP backward is still plain torch, whose gradient reductions across the
    TP ranks round differently; see docs/trainer_scale.md.)"""
    reference = tp_runs[0]
    assert len(tp_runs) == 6  # 2 ranks of (1, 2) + 4 ranks of (2, 2)
    for run in tp_runs:
        assert run["hashes"] == reference["hashes"]
        for ref, got in zip(reference["stats"], run["stats"], strict=True):
            assert {k: v for k, v in got.items() if not k.startswith(LAYOUT_KEY)} == \
                {k: v for k, v in ref.items() if not k.startswith(LAYOUT_KEY)}


def test_trainer_refuses_what_it_cannot_keep(model_factory, megatron):
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
