"""The user-facing layer of kimi-rl, the only package that drives both sides: the `kimi-rl`
command line, model creation (random tiny checkpoints and the SmolLM2 import), the whole config
(`config.py` combines the sections that live next to their owners), data and rewards, the
weight-sync hooks, Ray set-up, metrics, the parity checker and its report, multi-turn
environments with their tools and sandbox (`env.py`, `tools.py`, `sandbox.py`), and the driver loop
(`loop.py`, top to bottom). Errors from below arrive as plain exceptions; this package turns
them into the one-line `UserError` the CLI prints.

Imports: parity/, rollout/, trainer/.
"""
