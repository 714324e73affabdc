"""Issue 22's faults, as a user meets them: an alias bomb in the config, connections that promise a body
they never send, a huge number in a control API body, and a newcomer's first commands."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tfprofd.daemon import config as configmod
from tfprofd.daemon.problems import ConfigError

from helpers import metric_value, wait_for


def alias_bomb(key: str = "interval") -> str:
    """Nine levels of nine aliases: 300 bytes that PyYAML expands into 387 million values."""
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]")
    return "\n".join(lines) + f"\n{key}: *i\n"


def check_config(path: Path) -> subprocess.CompletedProcess:
    # The timeout only ends a hung command (the fault took > 60 s); the check itself takes about a second.
    return subprocess.run([sys.executable, "-m", "tfprofd.daemon", "check-config", str(path)], capture_output=True,
                          text=True, timeout=60)


# ---- 1. a YAML alias bomb ----

def test_check_config_rejects_an_alias_bomb_naming_file_line_and_key(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    result = check_config(path)
    assert result.returncode == 1, result.stderr
    assert f"{path}:10: interval: holds more than {configmod.MAX_CONFIG_VALUES} values once its aliases are " \
           "expanded" in result.stderr
    assert len(result.stderr) < 2000  # no expanded value in any message


@pytest.mark.parametrize("text, where", [
    (alias_bomb().replace("interval: *i", "collectors:\n  disk:\n    device_exclude: *i"),
     ":12: collectors.disk.device_exclude: holds more than"),
    (alias_bomb().replace("interval: *i", "rules: *i"), ":10: rules: holds more than"),
    ("interval: &x [1, *x]\n", ":1: interval: an alias in this value refers to the value itself"),
])
def test_bombs_and_self_referring_aliases_anywhere_are_refused_with_every_other_problem(tmp_path, text, where):
    path = tmp_path / "bomb.yaml"
    path.write_text(text + "log_level: loud\n")
    with pytest.raises(ConfigError) as exc:
        configmod.load(str(path), env={})
    message = str(exc.value)
    assert f"{path}{where}" in message
    assert "log_level: expected one of debug, info, warning, error, got 'loud'" in message


def test_a_huge_value_is_cut_short_in_its_message(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(f"interval: {'9' * 500}s\ncaptures:\n  keep: 1{'0' * 400}\n")
    with pytest.raises(ConfigError) as exc:
        configmod.load(str(path), env={"TFPROFD_CAPTURES_DURATION": "x" * 1_000_000})
    message = str(exc.value)
    assert len(message) < 1000, message
    assert "captures.keep: must be at most 100000, got <an integer of about" in message
    assert "env TFPROFD_CAPTURES_DURATION: captures.duration: expected a duration like 1s, 500ms or 5m, got 'xxx" \
        in message


def test_sighup_with_an_alias_bomb_is_rejected_and_the_agent_serves_and_stops(agents, tmp_path):
    config = tmp_path / "tfprofd.yaml"
    config.write_text("interval: 0.2s\n")
    agent = agents(args=["--config", str(config)])
    config.write_text(alias_bomb())
    agent.signal(signal.SIGHUP)
    wait_for(lambda: "config reload rejected" in agent.log(), 30, message="the bomb to be rejected")
    assert f"{config}:10: interval: holds more than" in agent.log()
    assert metric_value(agent.scrape(), "tfprofd_collector_success", collector="cpu") == 1
    agent.stop(timeout=60)
    assert agent.proc.returncode == 0, agent.log()


# ---- 2. connections that promise a body and never send it ----

def promise_a_body(port: int, request: bytes, count: int) -> list[socket.socket]:
    """``count`` connections that each send ``request`` (headers with Content-Length: 4000) and no body."""
    conns = []
    for _ in range(count):
        conn = socket.create_connection(("127.0.0.1", port), timeout=60)
        conn.sendall(request)
        conns.append(conn)
    return conns


def answer(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset after eviction ends it too)."""
    data = b""
    try:
        while chunk := conn.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    finally:
        conn.close()
    return data


def test_get_promising_a_body_is_refused_at_once_and_never_locks_out_a_scrape(agents):
    agent = agents()
    conns = promise_a_body(agent.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 4000\r\n\r\n", 200)
    assert metric_value(agent.scrape(), "tfprofd_collector_success", collector="cpu") == 1
    answers = [answer(conn) for conn in conns]  # none of them ever sends its body
    refused = [a for a in answers if a.startswith(b"HTTP/1.1 400 ") and b"a GET request takes no body" in a]
    # The others were closed, unanswered, to keep the bound of 128 (the flood came faster than they were read).
    evicted = metric_value(agent.scrape(), "tfprofd_http_connections_evicted_total", server="metrics")
    assert refused and len(answers) - len(refused) <= evicted, ({a[:60] for a in answers}, evicted)
    assert all(a == b"" for a in answers if a not in refused)


def test_posts_waiting_for_their_body_are_evicted_to_make_room(agents):
    agent = agents()
    request = (f"POST /api/v1/captures HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {agent.token}\r\n"
               "Content-Type: application/json\r\nContent-Length: 4000\r\n\r\n").encode()
    conns = promise_a_body(agent.api_port, request, 200)
    try:
        assert agent.call("GET", "/captures") == (200, {"captures": []})  # none of them was acted on
        evicted = metric_value(agent.scrape(), "tfprofd_http_connections_evicted_total", server="api")
        assert evicted and evicted > 0
    finally:
        for conn in conns:
            conn.close()


# ---- 3. a huge number in a control API body ----

@pytest.mark.parametrize("path, body", [
    ("/captures", b'{"duration_ms": 1%s}'),
    ("/captures", b'{"options": {"delay_ms": -1%s}}'),
    ("/captures", b'{"job": 1%s}'),
    ("/alerts", b'{"version": 1%s, "alerts": []}'),
    ("/alerts", b'{"alerts": [{"labels": {"alertname": 1%s}, "status": "firing"}]}'),
])
def test_a_five_thousand_digit_integer_in_a_body_is_a_400_with_its_reason(agents, path, body):
    agent = agents()
    status, answer = agent.call("POST", path, body % (b"0" * 4999))
    assert status == 400, answer
    assert answer == {"error": "body holds an integer of 5000 digits; at most 32 are accepted"}
    assert agent.call("GET", "/captures") == (200, {"captures": []})


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json_numbers(agents, constant):
    agent = agents()
    status, answer = agent.call("POST", "/captures", f'{{"duration_ms": {constant}}}'.encode())
    assert (status, answer) == (400, {"error": f"body is not valid JSON: {constant} is not a JSON number"})


# ---- 4. a newcomer's first commands ----

AGENT_DEPENDENCIES = ("yaml", "prometheus_client", "psutil", "pynvml", "grpc", "google", "xprof")


def tfprofd(*args: str, missing: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """The ``tfprofd`` command (its entry point) with ``missing`` modules not installed."""
    code = ("import sys\n"
            f"for name in {missing!r}: sys.modules[name] = None  # import fails: not installed\n"
            "from tfprofd.daemon.entry import main\n"
            f"sys.argv = ['tfprofd', *{list(args)!r}]\n"
            "sys.exit(main())\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "1000"})


def test_run_help_shows_defaults_as_a_user_writes_them():
    out = tfprofd("run", "--help").stdout
    lines: dict[str, str] = {}  # flag -> its help, on one line or two
    for line in out.splitlines():
        if line.strip().startswith("--"):
            flag = line.split()[0]
            lines[flag] = line
        elif lines:
            lines[flag] += " " + line.strip()
    assert lines["--interval"].endswith("Default: 1s.")
    assert lines["--captures.hold"].endswith("Default: 24h.")
    assert lines["--captures.delay"].endswith("Default: 0s.")
    assert lines["--captures.baseline-every"].endswith("Default: 6h.")
    assert lines["--captures.analyze"].endswith("Default: true.")
    assert lines["--api.token-file"].endswith("Default: none.")
    for raw in ("Default: 1.0.", "Default: 86400.0.", "Default: True.", "Default: False.", "Default: ."):
        assert raw not in out


def test_a_401_from_capture_names_the_token_file_it_read(agents, tmp_path):
    agent = agents()
    stale = tmp_path / "old-state"
    stale.mkdir()
    (stale / "api.token").write_text("a-token-from-an-older-agent\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TFPROFD_API_TOKEN", "TFPROFD_API_TOKEN_FILE")}
    result = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "capture", "--api", agent.api.removesuffix(
        "/api/v1")], capture_output=True, text=True, timeout=120, env={**env, "TFPROFD_STATE_DIR": str(stale)})
    assert result.returncode == 1
    assert "capture refused (401)" in result.stderr
    assert f"did not accept the token file {stale / 'api.token'}" in result.stderr
    assert "--token-file" in result.stderr


def test_capture_works_without_the_agents_dependencies(agents):
    agent = agents()
    token_file = agent.tmp / "state" / "api.token"
    result = tfprofd("capture", "--api", agent.api.removesuffix("/api/v1"), "--token-file", str(token_file),
                     missing=AGENT_DEPENDENCIES)
    assert result.returncode == 1
    assert result.stderr.startswith("tfprofd: capture refused (404): "), result.stderr  # no training job reports
    assert "training hook only" not in result.stderr
    help_text = tfprofd("capture", "--help", missing=AGENT_DEPENDENCIES)
    assert help_text.returncode == 0 and "--token-file" in help_text.stdout


def test_importing_the_callback_without_keras_says_so_in_one_line():
    code = ("import sys\n"
            "for name in ('keras', 'tf_keras', 'tensorflow'): sys.modules[name] = None\n"
            "from tfprofd.exporter.hook import TfprofdCallback\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "During handling of the above exception" not in result.stderr
    assert [line for line in result.stderr.splitlines() if not line.startswith(" ")][-2:] == [
        "Traceback (most recent call last):",
        "ImportError: TfprofdCallback needs Keras (Keras 3 or tf_keras) with TensorFlow: pip install tensorflow"]
    assert result.stderr.count("Traceback (most recent call last):") == 1, result.stderr
