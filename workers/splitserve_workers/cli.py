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
    # Two passes: find the subcommand, then let its module add its own arguments.
    known, _ = parser.parse_known_args(argv)
    if not known.command:
        parser.print_help()
        return 2
    module = importlib.import_module(known._module)
    sub_parser = parser._subparsers._group_actions[0].choices[known.command]  # type: ignore[union-attr]
    module.add_arguments(sub_parser)
    args = parser.parse_args(argv)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
