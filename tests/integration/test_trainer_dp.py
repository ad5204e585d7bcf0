"""Layout-invariant training (`trainer.deterministic_layout`) on the Megatron backend: three PPO
steps (LoRA policy, LoRA critic + value head, KL and entropy terms, two minibatches a step)
from one fixed batch give the same bits at (data_parallel_size, micro_batch_size) = (1, 1),
(1, 4), (2, 1) and (2, 4): the SHA-256 of every trainable tensor and every optimizer tensor,
and every metric, are equal, and each rank trains its share of tokens (> 0). The ordered step
is also the plain step's math: its first step's losses equal the plain path's to rounding.
"""

from __future__ import annotations

import hashlib
import os
import time

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


def _train(path: str, dp: int, micro: int, deterministic: bool) -> dict:
    """STEPS PPO steps at this layout; the hashes of the state and the stats of every step."""
    from trainer.megatron.policy import PolicyTrainer
    from trainer.step import Batch

    trainer = PolicyTrainer(
        path, "fp32", True, LoraConfig(enabled=True),
        TrainerConfig(lr=1e-2, micro_batch_size=micro, data_parallel_size=dp,
                      deterministic_layout=deterministic),
        AlgorithmConfig(name="ppo", minibatches=2, kl_coef=0.05, entropy_coef=0.01), seed=0,
    )
    stats, seconds = [], []
    for _ in range(STEPS):
        lp = trainer.logprobs(SEQS, STARTS)
        start = time.perf_counter()
        stats.append(trainer.train_step(Batch(SEQS, STARTS, lp, REWARDS, group_size=2)))
        seconds.append(time.perf_counter() - start)
    state = trainer.state_dict()
    hashes = {f"{part}.{k}": _sha(v) for part in ("policy", "critic") for k, v in state[part].items()}
    for i, s in state["optimizer"]["state"].items():
        hashes.update({f"optimizer.{i}.{k}": _sha(v) for k, v in s.items() if torch.is_tensor(v)})
    moved = sum(int(v.abs().sum() > 0) for v in state["critic"].values())
    return {"hashes": hashes, "stats": stats, "seconds": seconds, "moved": moved}


def _rank(rank: int, size: int, rendezvous: str, path: str, out: str) -> None:
    """One process of a world of `size` data-parallel ranks: every layout of that world."""
    from trainer.megatron.patches import init_megatron
    from trainer.megatron.worker import init_world

    torch.set_num_threads(1)
    init_world(rank, size, rendezvous)
    init_megatron(seed=0)
    runs = {f"dp{size}-mb{micro}": _train(path, size, micro, True) for micro in (1, 4)}
    if size == 1:
        runs["plain-mb4"] = _train(path, 1, 4, False)
    torch.save(runs, os.path.join(out, f"rank{rank}.pt"))


def _world(path: str, size: int, tmp) -> list[dict]:
    out = tmp / f"dp{size}"
    out.mkdir()
    mp.spawn(_rank, nprocs=size, join=True, args=(size, str(out / "store"), path, str(out)))
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(size)]


@pytest.fixture(scope="module")
def runs(model_factory, tmp_path_factory):
    path = model_factory("llama", "fp32")
    tmp = tmp_path_factory.mktemp("trainer-dp")
    (one,) = _world(path, 1, tmp)
    rank0, rank1 = _world(path, 2, tmp)
    return one, (rank0, rank1)


def _layouts(runs) -> dict[str, dict]:
    one, (rank0, rank1) = runs
    return {"dp1-mb1": one["dp1-mb1"], "dp1-mb4": one["dp1-mb4"],
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
    _, (rank0, _) = runs
    for micro in (1, 4):
        for stats in rank0[f"dp2-mb{micro}"]["stats"]:
            shares = [stats[f"{LAYOUT_KEY}{r}"] for r in range(2)]
            assert all(s > 0 for s in shares), shares
            # Each optimizer step's minibatch is split whole: the shares add up to its tokens.
            per_minibatch = stats["train/response_tokens"] / stats["train/optimizer_steps"]
            assert sum(shares) == pytest.approx(per_minibatch)


def test_ordered_step_is_the_plain_steps_math(runs):
    """Same loss and gradient as the plain micro-batched step, up to the summation order."""
    one, _ = runs
    ordered, plain = one["dp1-mb4"]["stats"][0], one["plain-mb4"]["stats"][0]
    for k in ("ppo/policy_loss", "critic/value_loss", "ppo/grad_norm", "critic/grad_norm", "ppo/entropy"):
        assert ordered[k] == pytest.approx(plain[k], rel=1e-4, abs=1e-7), k
    print({k: [round(s, 3) for s in one[k]["seconds"]] for k in ("dp1-mb4", "plain-mb4")})


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
