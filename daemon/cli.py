"""The ``tfprofd`` command: ``run`` the agent, ``check-config`` a file, and the client subcommands.

``capture`` (client.py) needs the standard library alone: this module imports the agent's config (and so
PyYAML) only for the commands that need it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import __version__, client


def _add_option_flags(parser: argparse.ArgumentParser) -> None:
    from . import config as configmod

    group = parser.add_argument_group("options (each also settable as env var and in the YAML file)")
    for option in configmod.OPTIONS:
        if "flag" in option.meta["sources"]:
            group.add_argument(option.flag, dest=option.key, default=None, metavar="VALUE",
                               help=f"{option.meta['help']} Env {option.env}. Default: {option.show_default()}.")


def _option_flags(args: argparse.Namespace) -> dict[str, Any]:
    from . import config as configmod

    values = vars(args)
    return {o.key: values[o.key] for o in configmod.OPTIONS if values.get(o.key) is not None}


def build_parser() -> argparse.ArgumentParser:
    from . import config as configmod

    parser = argparse.ArgumentParser(prog="tfprofd", description=(
        "GPU training-host agent: exports GPU, host and training metrics to Prometheus and captures "
        "TensorFlow profiles when utilization drops."))
    parser.add_argument("--version", action="version", version=f"tfprofd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the agent")
    run.add_argument("--config", default=os.environ.get(configmod.CONFIG_ENV),
                     help=f"YAML config file (env {configmod.CONFIG_ENV}); without one the built-in defaults apply")
    _add_option_flags(run)

    check = sub.add_parser("check-config", help="validate a config file and print every problem at once")
    check.add_argument("path")

    # Listed for --help; main() hands these to their modules' own parsers.
    sub.add_parser("analyze", help="say what bound the training step in a profile (tfprofd analyze --help)")
    sub.add_parser("demo", help="agent + Keras job + input bottleneck + capture + analysis, in about a minute")

    sub.add_parser("capture", help=f"{client.HELP} (tfprofd capture --help)")
    return parser


def _exit(code: int) -> None:
    """Leave now: nothing (a thread blocked in a library call) may hold up a stopped agent's exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_run(args: argparse.Namespace) -> int:
    from . import config as configmod
    from .agent import Agent, StartError, limit_malloc_arenas
    from .api import TokenError

    flags = _option_flags(args)

    def load() -> configmod.Config:
        return configmod.load(args.config, os.environ, flags)

    try:
        cfg = load()
    except configmod.ConfigError as exc:
        print(f"tfprofd: invalid configuration ({len(exc.problems)} problem(s)):", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    limit_malloc_arenas()
    agent = Agent(cfg, reload_source=load)
    agent.install_signal_handlers()
    try:
        agent.start()
    except (StartError, TokenError, OSError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"tfprofd: cannot start: {reason}", file=sys.stderr)
        agent.stop()
        _exit(1)
    agent.wait()
    _exit(0)
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    from . import config as configmod

    problems = []
    try:
        cfg = configmod.load(args.path, env={})
    except configmod.ConfigError as exc:
        problems = [str(p) for p in exc.problems]
    else:
        if cfg.api.token_file:
            from .api import Token, TokenError

            try:
                Token("", Path(cfg.api.token_file))
            except TokenError as exc:
                problems.append(f"{args.path}: api.token_file: {exc}")
    if problems:
        print(f"{args.path}: {len(problems)} problem(s):", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print(f"{args.path}: OK")
    return 0


COMMANDS = {"run": cmd_run, "check-config": cmd_check_config}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["analyze"]:
        from .analysis.cli import main as analyze_main

        return analyze_main(argv[1:])
    if argv[:1] == ["capture"]:
        return client.main(argv[1:])
    if argv[:1] == ["demo"]:
        from .demo import main as demo_main

        return demo_main(argv[1:])
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
