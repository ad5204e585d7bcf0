"""kimi-rl's test suite: kernel property tests, HF <-> Megatron conversion, and the parity
tests that drive the real vLLM engine and the real Megatron model, and end-to-end training runs
through real Ray, on tiny checkpoints that the tests build themselves (no hub, no network)."""
