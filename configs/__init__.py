"""Example YAML configs for `kimi-rl`; `quickstart.yaml` is the embedded default."""
