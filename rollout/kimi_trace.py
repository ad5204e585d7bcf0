"""The Kimi parity models' routing trace (kimi-mini and kimi-linear), a debug wrapper kept out
of the production forward: forward hooks on a parity model's layers record, per engine step,
each token's request key (the request's first state / cache block) and position, the experts
each MoE layer chose and the positions each indexer selected. Tests compare that with the
trainer's teacher-forced routing (`trace_by_request` reassembles the steps per request).
Nothing here runs unless a trace is on.

The hooks recompute what they report from the layer's inputs, with the model's own functions:
the router (`parity.kimi.route_module`, a pure function of the hidden states) and the MLA
layer's `select` (idempotent: it rewrites the same cache entries and re-runs the indexer).
"""

from __future__ import annotations

import torch

from parity import kimi


class RoutingTrace:
    def __init__(self, model) -> None:
        self.steps: list[dict] = []
        self._step: dict = {}
        self._n = 0  # tokens of this step (the first layer's metadata says)
        spec = model.spec
        self._positions = torch.zeros(0, dtype=torch.int64)
        hooks = [
            model.register_forward_pre_hook(self._begin),
            model.register_forward_hook(self._end),
            # every layer is called as layer(positions, x): the first one tells the positions
            model.model.layers[0].register_forward_pre_hook(self._take_positions),
        ]
        for i, layer in enumerate(model.model.layers):
            hooks.append(layer.self_attn.register_forward_hook(self._mixer_hook(i, layer.kind)))
            if hasattr(layer.ffn, "gate"):  # kimi-linear's first_k_dense_replace layers route nothing
                hooks.append(layer.ffn.register_forward_hook(self._moe_hook(i, spec)))
        self._hooks = hooks

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

    def take(self) -> list[dict]:
        """The steps recorded since the last take (recording continues)."""
        steps, self.steps = self.steps, []
        return steps

    def _begin(self, model, args) -> None:
        self._step, self._n = {}, 0

    def _take_positions(self, layer, args) -> None:
        self._positions = args[0]

    def _end(self, model, args, output) -> None:
        if self._step:
            self.steps.append(self._step)

    def _mixer_hook(self, i: int, kind: str):
        def hook(module, args, output) -> None:
            meta = module.step_metadata()
            if meta is None:  # profiling / warm-up run
                return
            n = meta.num_query_tokens
            step = self._step
            if kind == "kda":
                key = meta.state_index
                q_seq = torch.repeat_interleave(torch.arange(meta.num_reqs), torch.tensor(meta.query_lens))
            else:
                positions, h = args
                _, _, selected, count = module.select(meta, positions, h)
                key = meta.block_table[:, 0].to(device="cpu", dtype=torch.int64)
                q_seq = meta.q_seq
                step[f"layers.{i}.self_attn.selected"] = selected.clone()
                step[f"layers.{i}.self_attn.count"] = count.clone()
            if "keys" not in step:  # the first layer that ran names the requests
                positions = self._positions
                step["keys"] = key[q_seq].clone()
                step["positions"] = positions[:n].to(torch.int64).clone()
            self._n = n

        return hook

    def _moe_hook(self, i: int, spec):
        def hook(module, args, output) -> None:
            if not self._n:
                return
            (h,) = args
            experts, _ = kimi.route_module(module, spec, h)
            self._step[f"layers.{i}.mlp.experts"] = experts[: self._n].clone()

        return hook


def trace_by_request(steps: list[dict]) -> list[dict[str, torch.Tensor]]:
    """Per request (in order of first appearance at position 0), over the positions 0..P-1 the
    engine processed: {"layers.{i}.mlp.experts": int64 [P, k], "layers.{i}.self_attn.selected":
    int64 [P, topk], "layers.{i}.self_attn.count": [P]}. A key (the request's first block) is
    reused after its request ends; a token at position 0 always starts a new request."""
    requests: list[dict[str, list]] = []
    live: dict[int, int] = {}
    for step in steps:
        names = [k for k in step if k.startswith("layers.")]
        for t, (key, pos) in enumerate(zip(step["keys"].tolist(), step["positions"].tolist(), strict=True)):
            if pos == 0:
                live[key] = len(requests)
                requests.append({"positions": [], **{name: [] for name in names}})
            rec = requests[live[key]]
            rec["positions"].append(pos)
            for name in names:
                rec[name].append(step[name][t])
    out = []
    for rec in requests:
        positions = rec.pop("positions")
        if positions != list(range(len(positions))):
            raise RuntimeError(f"trace positions are not 0..P-1: {positions[:8]}...")
        out.append({name: torch.stack(rows).to(torch.int64) for name, rows in rec.items()})
    return out
