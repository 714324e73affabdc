"""``tfprofd capture``: the control API's command-line client.

Standard library only (the analysis report it prints is too), so it works on a hook-only install, where
the agent's dependencies (PyYAML, prometheus_client, ...) are absent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tfprofd.exporter.options import parse_duration

HELP = "ask the running agent to capture a profile now"


def default_state_dir(euid: int | None = None) -> str:
    """The agent's state directory when none is configured: the system one for root, else the user's own."""
    if (os.geteuid() if euid is None else euid) == 0:
        return "/var/lib/tfprofd"
    return str(Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local/state") / "tfprofd")


def token_file_candidates() -> list[Path]:
    """Where a local agent's generated token may be, in the order looked at: the system agent's, then this user's."""
    dirs = [os.environ.get("TFPROFD_STATE_DIR"), default_state_dir(0), default_state_dir()]
    return list(dict.fromkeys(Path(d) / "api.token" for d in dirs if d))


def default_token_file() -> Path | None:
    """The token a local agent generated: the system agent's, else this user's."""
    return next((path for path in token_file_candidates() if path.is_file()), None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tfprofd capture", description=HELP)
    parser.add_argument("--job", help="training job to profile (needed when several report)")
    parser.add_argument("--all-hosts", action="store_true", help="with --job: every worker of the job on every "
                        "host (the agents found through cluster.prometheus_url or cluster.peers), in one window")
    parser.add_argument("--gpu", help="profile the job running on this GPU index")
    parser.add_argument("--duration", help="how long to trace, e.g. 2s (default: captures.duration)")
    parser.add_argument("--wait", action="store_true", help="wait for the capture to finish and print what its "
                        "analysis found")
    parser.add_argument("--json", action="store_true", help="with --wait: print the whole record as JSON")
    parser.add_argument("--api", default=os.environ.get("TFPROFD_API", "http://127.0.0.1:9848"),
                        help="the agent's control API (env TFPROFD_API; default http://127.0.0.1:9848)")
    parser.add_argument("--token-file", default=os.environ.get("TFPROFD_API_TOKEN_FILE"),
                        help="file with the agent's bearer token (env TFPROFD_API_TOKEN_FILE; default: the "
                             "agent's api.token in /var/lib/tfprofd or your own state directory)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    headers = {"Content-Type": "application/json"}
    token_file = Path(args.token_file) if args.token_file else default_token_file()
    looked_in = ", ".join(map(str, token_file_candidates()))
    token = os.environ.get("TFPROFD_API_TOKEN", "").strip()
    if token:
        source = "the token in env TFPROFD_API_TOKEN"
    elif token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            print(f"tfprofd: cannot read the API token {token_file}: {exc.strerror} (are you in the agent's "
                  "group?)", file=sys.stderr)
            return 1
        source = f"the token file {token_file}" + ("" if args.token_file else f" (found by looking in {looked_in})")
    else:
        source = f"a request without a token (none given; no api.token in {looked_in})"
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
    if args.all_hosts and (not args.job or args.gpu is not None):
        print("tfprofd: --all-hosts needs --job and no --gpu", file=sys.stderr)
        return 2
    if args.job:
        body["job"] = args.job
    if args.all_hosts:
        body["scope"] = "job"
    if args.gpu is not None:
        body["gpu"] = args.gpu
    if args.duration:
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
        if status == 401:
            print(f"tfprofd: the agent at {args.api} did not accept {source}; give the token file that agent "
                  "uses with --token-file (or env TFPROFD_API_TOKEN_FILE)", file=sys.stderr)
        return 1
    print(f"{'job-wide ' if args.all_hosts else ''}capture {answer['id']} started for job {answer['job']}", flush=True)
    if not args.wait:
        return 0
    while True:
        status, record = call("GET", answer["url"])
        if record.get("status") not in ("running", "analyzing"):
            break
        time.sleep(0.5)
    if args.json:
        print(json.dumps(record, indent=1, sort_keys=True))
    elif record.get("scope") == "job":
        print(job_report(record))
    elif record.get("analysis"):
        from .analysis import CaptureAnalysis, report

        print(report(CaptureAnalysis.from_json(record["analysis"])))
    else:
        print(f"status: {record.get('status')}: {record.get('reason')}: {record.get('detail')}")
    return 0 if record.get("status") == "done" else 1


def job_report(record: dict[str, Any]) -> str:
    """A job record for a person: every worker, the skew, the straggler against the median worker, the peers
    that failed."""
    skew = record.get("window_skew_ms")
    lines = [f"job {record['job']}: {record['status']}: {len(record['workers'])} worker(s)"
             + (f", windows {skew:.1f} ms apart" if skew is not None else "")]
    for w in record["workers"]:
        step = f"{w['step_ms']:.1f} ms per step" if w.get("step_ms") else "no steps"
        lines.append(f"  {w['worker']} on {w['peer']}: {step}")
    straggler = record.get("straggler")
    lines.append(f"straggler: {straggler['why']}" if straggler else "no straggler")
    if record.get("comparison"):
        lines.append(f"compared: {record['comparison']['summary']}")
    lines += [f"failed: {f['peer']}: {f['why']}" for f in record.get("failed", [])]
    lines += [f"refused: {f['peer']}: {f['why']}" for f in record.get("refused", [])]
    return "\n".join(lines)
