"""The user-facing layer of kimi-rl: the `kimi-rl` command line, model creation (random tiny
checkpoints and the SmolLM2 import), configuration, PPO math, data and rewards, the weight-sync hooks, Ray set-up, metrics and the
driver loop. Everything
here talks to the rollout side (`rollout/`) and the trainer side (`trainer/`) only through
their public functions, so the whole algorithm can be read top to bottom in this package."""
