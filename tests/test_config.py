"""Config validation: every bad input is reported with its file, line and key, all at once; hostile files
give clear errors, never a traceback."""

from __future__ import annotations

import codecs
import random
import subprocess
import sys
import textwrap

import pytest

from tfprofd.daemon import config


def write(tmp_path, text: str | bytes, name: str = "tfprofd.yaml"):
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(textwrap.dedent(text))
    return str(path)


def problems(path, **kwargs) -> list[str]:
    with pytest.raises(config.ConfigError) as info:
        config.load(path, env=kwargs.get("env", {}), flags=kwargs.get("flags"))
    return [str(p) for p in info.value.problems]


def test_defaults_need_no_file():
    cfg = config.load(None, env={})
    assert cfg.core.listen == ("0.0.0.0", 9847)
    assert cfg.api.listen == ("127.0.0.1", 9848)
    assert cfg.core.interval == 1.0
    assert cfg.collectors["nvml"].enabled is True
    assert cfg.captures.mode == "agent"
    assert cfg.hook.listen is None and cfg.hook.socket.endswith("/tfprofd/hook.sock")


def test_yaml_env_and_flags_in_order_of_precedence(tmp_path):
    path = write(tmp_path, """
        interval: 2s
        collectors:
          nvml:
            pcie_interval: 30s
          disk:
            enabled: false
    """)
    cfg = config.load(path, env={"TFPROFD_INTERVAL": "500ms", "TFPROFD_COLLECTORS_NVML_PCIE_INTERVAL": "20s"},
                      flags={"collectors.nvml.pcie_interval": "15s"})
    assert cfg.core.interval == 0.5
    assert cfg.collectors["nvml"].pcie_interval == 15.0
    assert cfg.collectors["disk"].enabled is False
    assert cfg.value("collectors.disk.enabled") is False


def test_bad_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, """
        interval: 1s
        collectors:
          nvml: [unclosed
    """)
    [problem] = problems(path)
    assert problem.startswith(f"{path}:") and "invalid YAML" in problem


def test_every_problem_is_reported_once_with_line_and_key(tmp_path):
    path = write(tmp_path, """
        interval: 0s
        listen: nowhere
        collectors:
          nvml:
            enabled: maybe
          cpu:
            enabeld: true
        colectors: {}
    """)
    found = problems(path)
    assert len(found) == 5, found
    assert f"{path}:2: interval: must be at least 0.1, got 0" in found
    assert f"{path}:3: listen: expected host:port, got 'nowhere'" in found
    assert f"{path}:6: collectors.nvml.enabled: expected true or false, got 'maybe'" in found
    assert any(p.startswith(f"{path}:8: collectors.cpu.enabeld: unknown key") and "collectors.cpu.enabled" in p
               for p in found)
    assert any(p.startswith(f"{path}:9: colectors: unknown key") for p in found)


def test_wrong_type_and_duplicate_key(tmp_path):
    path = write(tmp_path, """
        interval: [1, 2]
        log_level: loud
        log_level: info
    """)
    found = problems(path)
    assert f"{path}:2: interval: expected a duration like 1s, 500ms or 5m, got [1, 2]" in found
    assert f"{path}:3: log_level: expected one of debug, info, warning, error, got 'loud'" in found
    assert f"{path}:4: log_level: duplicate key" in found


def test_env_and_flag_problems_name_their_source():
    found = problems(None, env={"TFPROFD_INTERVAL": "soon"}, flags={"api.listen": "127.0.0.1:99999"})
    assert "env TFPROFD_INTERVAL: interval: expected a duration like 1s, 500ms or 5m, got 'soon'" in found
    assert "flag --api.listen: api.listen: port must be 0..65535, got 99999" in found


def test_metrics_and_the_control_api_on_one_address_are_refused_naming_where():
    found = problems(None, flags={"listen": "127.0.0.1:9500", "api.listen": "127.0.0.1:9500"})
    assert found == ["flag --api.listen: api.listen: must differ from listen: /metrics and the control API are "
                     "separate listeners"], found
    loaded = config.load(None, env={}, flags={"listen": "127.0.0.1:0", "api.listen": "127.0.0.1:0"})
    assert loaded.core.listen == loaded.api.listen == ("127.0.0.1", 0)  # port 0 twice: two ports the kernel picks


@pytest.mark.parametrize(("text", "key", "message"), [
    ("interval: .nan\n", "interval", "finite"),
    ("interval: .inf\n", "interval", "finite"),
    ("captures:\n  duration: .nan\n", "captures.duration", "finite"),
    ("captures:\n  timeout: -5\n", "captures.timeout", "0 or more"),
    ("hook:\n  max_jobs: .nan\n", "hook.max_jobs", "integer"),
    ("captures:\n  dir_mode: 777\n", "captures.dir_mode", "world-writable"),
    ("captures:\n  dir_mode: 2770\n", "captures.dir_mode", "setgid"),
    ("captures:\n  dir_mode: rwx\n", "captures.dir_mode", "octal"),
    ("listen: 'bad host!:9847'\n", "listen", "IP address or host name"),
])
def test_values_that_cannot_work_are_rejected_with_their_reason(tmp_path, text, key, message):
    path = write(tmp_path, text)
    [problem] = problems(path)
    assert problem.startswith(f"{path}:") and f": {key}: " in problem and message in problem, problem


def test_dir_mode_is_octal_as_for_chmod(tmp_path):
    assert config.load(write(tmp_path, "captures:\n  dir_mode: 770\n"), env={}).captures.dir_mode == 0o770
    assert config.load(write(tmp_path, "captures:\n  dir_mode: '0750'\n"), env={}).captures.dir_mode == 0o750
    assert config.load(None, env={"TFPROFD_CAPTURES_DIR_MODE": "0o700"}).captures.dir_mode == 0o700


@pytest.mark.parametrize(("rule", "key", "message"), [
    ("for: -30", "rules[0].for", "0 or more"),
    ("cooldown: -1", "rules[0].cooldown", "0 or more"),
    ("window: -5\n    aggregate: mean", "rules[0].window", "0 or more"),
    ("for: .nan", "rules[0].for", "finite"),
])
def test_negative_or_nan_rule_durations_are_rejected(tmp_path, rule, key, message):
    path = write(tmp_path, f"rules:\n  - name: r\n    signal: gpu_utilization\n    below: 0.5\n    {rule}\n")
    found = problems(path)
    assert any(f": {key}: " in p and message in p for p in found), found


def test_the_api_token_is_never_read_from_a_flag_or_the_file(tmp_path):
    path = write(tmp_path, "api:\n  token: s3cret\n")
    [problem] = problems(path)
    assert problem == (f"{path}:2: api.token: not read from the config file (a secret): "
                       "set env TFPROFD_API_TOKEN instead")
    assert config.load(None, env={"TFPROFD_API_TOKEN": "s3cret"}).api.token == "s3cret"
    help_text = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "run", "--help"], capture_output=True,
                               text=True).stdout
    assert "--api.token-file" in help_text and "--api.token " not in help_text and "--api.token\n" not in help_text


# ---- hostile files: each a clear error with the file's name (and line where there is one) ----

def _deep(n: int) -> bytes:
    return b"interval: " + b"[" * n + b"]" * n + b"\n"


HOSTILE = {
    "binary garbage": random.Random(7).randbytes(3000),
    "invalid UTF-8": b"interval: 2s\nlog_level: \xff\xfeinfo\n",
    "invalid UTF-16": codecs.BOM_UTF16_LE + "interval: 2s\n".encode("utf-16-le")[:-1] + b"\x00\xd8",
    "NUL byte": b"interval: 2s\x00\n",
    "NUL in a value": b'log_level: "info\\0"\n',
    "5000-deep list": _deep(5000),
    "5000-deep mapping": b"a: " + b"{b: " * 5000 + b"1" + b"}" * 5000 + b"\n",
    "rule signal as a list": b"rules:\n  - name: r\n    signal: [gpu_utilization]\n    below: 0.5\n",
    "rule signal as a mapping": b"rules:\n  - name: r\n    signal: {a: 1}\n    below: 0.5\n",
    "a key that is a mapping": b"{a: 1}: 2\n",
    "timestamp that is no date": b"state_dir: 2026-13-45\n",
    "huge file": b"# " + b"x" * (5 * 1024 * 1024) + b"\n",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_file_gives_a_clear_error_not_a_traceback(tmp_path, name):
    path = write(tmp_path, HOSTILE[name])
    found = problems(path)
    assert found and all(p.startswith(path) for p in found), found


def test_utf16_with_a_byte_order_mark_is_read(tmp_path):
    path = write(tmp_path, codecs.BOM_UTF16_LE + "interval: 2s\n".encode("utf-16-le"))
    assert config.load(path, env={}).core.interval == 2.0


def test_check_config_and_run_print_file_errors_for_hostile_files(tmp_path):
    for name in ("binary garbage", "5000-deep list", "rule signal as a list"):
        path = write(tmp_path, HOSTILE[name], name="bad.yaml")
        check = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "check-config", path], capture_output=True,
                               text=True, timeout=60)
        assert check.returncode == 1 and "Traceback" not in check.stderr and path in check.stderr, check.stderr
        run = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "run", "--config", path], capture_output=True,
                             text=True, timeout=60)
        assert run.returncode == 2 and "Traceback" not in run.stderr and path in run.stderr, run.stderr


def test_check_config_command_prints_all_problems(tmp_path):
    path = write(tmp_path, "interval: -1\nbogus: 1\n")
    result = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "check-config", path],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert f"{path}:1: interval: expected a duration of 0 or more" in result.stderr
    assert f"{path}:2: bogus: unknown key" in result.stderr
    good = write(tmp_path, "interval: 2s\n")
    ok = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "check-config", good], capture_output=True, text=True)
    assert ok.returncode == 0 and "OK" in ok.stdout


def test_check_config_refuses_a_missing_or_empty_token_file(tmp_path):
    empty = tmp_path / "token"
    empty.write_text("\n")
    empty.chmod(0o600)
    for token_file, reason in ((tmp_path / "missing", "cannot read"), (empty, "is empty")):
        path = write(tmp_path, f"api:\n  token_file: {token_file}\n")
        result = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "check-config", path], capture_output=True,
                                text=True)
        assert result.returncode == 1 and reason in result.stderr, result.stderr


def test_run_refuses_invalid_config_and_exits_2(tmp_path):
    path = write(tmp_path, "interval: fast\n")
    result = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "run", "--config", path],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert f"{path}:1: interval" in result.stderr
