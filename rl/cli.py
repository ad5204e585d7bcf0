"""`kimi-rl` command line. Each subcommand lives next to the code it drives; this file only
wires them together and turns `UserError` into a one-line message with exit code 2."""

from __future__ import annotations

import argparse
import sys

from rl.errors import UserError


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _version() -> str:
    """The installed distribution's version; from a source tree that is not installed
    (`python -m rl.cli` in a checkout, as on a GPU machine's bundle), pyproject.toml's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kimi-rl")
    except PackageNotFoundError:
        import tomllib
        from pathlib import Path

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"] + " (source tree)"


def build_parser() -> argparse.ArgumentParser:
    from rl.checker import add_parity_commands
    from rl.loop import add_train_commands
    from rl.models import add_model_commands

    parser = _Parser(prog="kimi-rl", description="kimi-rl: RL with bit-identical rollout/trainer log-probs")
    parser.add_argument("--version", action="version", version=f"kimi-rl {_version()}")
    parser.add_argument("--verbose", action="store_true",
                        help="show every third-party warning and log line (also: KIMI_RL_VERBOSE=1); "
                        "by default the known noisy ones are hidden (rl/quiet.py)")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_model_commands(commands)
    add_parity_commands(commands)
    add_train_commands(commands)
    return parser


def _check_isa() -> None:
    """KIMI_RL_ISA (the parity kernels' code path, parity/native.py) is read by every process
    that computes: a bad value ends the command here, in one line, not in a worker's trace."""
    from parity import native

    try:
        native.check_isa_environment()
    except ValueError as e:
        raise UserError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    from rl import quiet

    argv = list(sys.argv[1:] if argv is None else argv)
    # Before anything imports torch, vLLM or DeepSpeed: the filters and the environment they
    # set must be in place when those load. `--verbose` counts anywhere on the line.
    verbose = "--verbose" in argv
    argv = [word for word in argv if word != "--verbose"]
    quiet.install(verbose)

    from parity.hf_config import register_hf_config

    # A CLI process registers what it needs itself: kimi-mini's model_type is unknown to
    # transformers, and the tokenizer / config of a model directory load through AutoConfig
    # before any vLLM plugin has run.
    register_hf_config()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse gives a trailing positional list only the words before the first option, so
        # `train x.yaml --resume DIR total_steps=30` leaves the override over: take it as one.
        if getattr(args, "overrides", None) is not None and all(
            "=" in word and not word.startswith("-") for word in extra
        ):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        _check_isa()
        return int(args.func(args) or 0)
    except UserError as e:
        sys.stderr.write(f"kimi-rl: error: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
