"""The `splitserve` command. Each subcommand lives in its own module, imported only when used
(so `splitserve operator` never imports torch); a module provides `add_arguments(parser)` and
`run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Order is the order `splitserve --help` shows.
COMMANDS: dict[str, tuple[str, str]] = {
    "prefill": ("splitserve_workers.prefill_worker", "Prefill worker: prompt -> first token + KV."),
    "decode": ("splitserve_workers.decode_worker", "Decode worker: reserve, receive KV, generate."),
    "colocated": ("splitserve_workers.colocated_worker", "Worker doing prefill and decode."),
    "router": ("splitserve_workers.router.app", "OpenAI-compatible router in front of the pools."),
    "up": ("splitserve_workers.local", "Run router + prefill/decode pools locally (local mode)."),
    "operator": ("splitserve_operator.cli", "Run the LLMService operator (kopf)."),
    "make-model": (
        "splitserve_workers.engine.make_model",
        "Write a random-weight model in Hugging Face format.",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    from splitserve_workers import __version__

    parser = argparse.ArgumentParser(
        prog="splitserve",
        description="Disaggregated prefill/decode LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"splitserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # The subcommand's module adds its own arguments before parsing, so `splitserve X --help`
    # lists them; the top-level parser only has --help and --version before the command.
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in COMMANDS:
        parser.parse_args(argv)  # prints help/version, or the error for an unknown command
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    sub_parser = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    module.add_arguments(sub_parser)
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the subcommand's usage, not the top-level one
        sub_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
