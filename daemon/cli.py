"""The ``tfprofd`` command: ``run`` the agent, ``check-config`` a file, and the client subcommands."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import __version__
from . import config as configmod


def _add_option_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("options (each also settable as env var and in the YAML file)")
    for option in configmod.OPTIONS:
        if "flag" in option.meta["sources"]:
            group.add_argument(option.flag, dest=option.key, default=None, metavar="VALUE",
                               help=f"{option.meta['help']} Env {option.env}. Default: {option.show_default()}.")


def _option_flags(args: argparse.Namespace) -> dict[str, Any]:
    values = vars(args)
    return {o.key: values[o.key] for o in configmod.OPTIONS if values.get(o.key) is not None}


def build_parser() -> argparse.ArgumentParser:
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

    capture = sub.add_parser("capture", help="ask the running agent to capture a profile now")
    capture.add_argument("--job", help="training job to profile (needed when several report)")
    capture.add_argument("--gpu", help="profile the job running on this GPU index")
    capture.add_argument("--duration", help="how long to trace, e.g. 2s (default: captures.duration)")
    capture.add_argument("--wait", action="store_true", help="wait for the capture to finish and print what its "
                         "analysis found")
    capture.add_argument("--json", action="store_true", help="with --wait: print the whole record as JSON")
    capture.add_argument("--api", default=os.environ.get("TFPROFD_API", "http://127.0.0.1:9848"),
                         help="the agent's control API (env TFPROFD_API; default http://127.0.0.1:9848)")
    capture.add_argument("--token-file", default=os.environ.get("TFPROFD_API_TOKEN_FILE"),
                         help="file with the agent's bearer token (env TFPROFD_API_TOKEN_FILE; default: the "
                              "agent's api.token in /var/lib/tfprofd or your own state directory)")
    return parser


def _exit(code: int) -> None:
    """Leave now: nothing (a thread blocked in a library call) may hold up a stopped agent's exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_run(args: argparse.Namespace) -> int:
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


def default_token_file() -> Path | None:
    """The token a local agent generated: the system agent's, else this user's."""
    for state_dir in (os.environ.get("TFPROFD_STATE_DIR"), configmod.default_state_dir(0),
                      configmod.default_state_dir()):
        if state_dir and (Path(state_dir) / "api.token").is_file():
            return Path(state_dir) / "api.token"
    return None


def cmd_capture(args: argparse.Namespace) -> int:
    import json
    import time
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    token_file = Path(args.token_file) if args.token_file else default_token_file()
    token = os.environ.get("TFPROFD_API_TOKEN", "").strip()
    if not token and token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            print(f"tfprofd: cannot read the API token {token_file}: {exc.strerror} (are you in the agent's "
                  "group?)", file=sys.stderr)
            return 1
    if token:
        headers["Authorization"] = "Bearer " + token

    def call(method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(args.api.rstrip("/") + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    body: dict[str, Any] = {}
    if args.job:
        body["job"] = args.job
    if args.gpu is not None:
        body["gpu"] = args.gpu
    if args.duration:
        from tfprofd.exporter.options import parse_duration

        try:
            body["duration_ms"] = int(parse_duration(args.duration) * 1000)
        except ValueError as exc:
            print(f"tfprofd: --duration: {exc}", file=sys.stderr)
            return 2
    try:
        status, answer = call("POST", "/api/v1/captures", body)
    except OSError as exc:
        print(f"tfprofd: cannot reach the agent at {args.api}: {exc}", file=sys.stderr)
        return 1
    if status != 202:
        print(f"tfprofd: capture refused ({status}): {answer.get('error', answer)}", file=sys.stderr)
        return 1
    print(f"capture {answer['id']} started for job {answer['job']}", flush=True)
    if not args.wait:
        return 0
    while True:
        status, record = call("GET", answer["url"])
        if record.get("status") not in ("running", "analyzing"):
            break
        time.sleep(0.5)
    if args.json:
        print(json.dumps(record, indent=1, sort_keys=True))
    elif record.get("analysis"):
        from .analysis import CaptureAnalysis, report

        print(report(CaptureAnalysis.from_json(record["analysis"])))
    else:
        print(f"status: {record.get('status')}: {record.get('reason')}: {record.get('detail')}")
    return 0 if record.get("status") == "done" else 1


COMMANDS = {"run": cmd_run, "check-config": cmd_check_config, "capture": cmd_capture}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["analyze"]:
        from .analysis.cli import main as analyze_main

        return analyze_main(argv[1:])
    if argv[:1] == ["demo"]:
        from .demo import main as demo_main

        return demo_main(argv[1:])
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
