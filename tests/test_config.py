"""Config validation: every bad input is reported with its file, line and key, all at once."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tfprofd.daemon import config


def write(tmp_path, text: str):
    path = tmp_path / "tfprofd.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def problems(path, **kwargs) -> list[str]:
    with pytest.raises(config.ConfigError) as info:
        config.load(path, env=kwargs.get("env", {}), flags=kwargs.get("flags"))
    return [str(p) for p in info.value.problems]


def test_defaults_need_no_file():
    cfg = config.load(None, env={})
    assert cfg["listen"] == ("0.0.0.0", 9847)
    assert cfg["api.listen"] == ("127.0.0.1", 9848)
    assert cfg["interval"] == 1.0
    assert cfg["collectors.nvml.enabled"] is True


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
    assert cfg["interval"] == 0.5
    assert cfg["collectors.nvml.pcie_interval"] == 15.0
    assert cfg["collectors.disk.enabled"] is False


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


def test_check_config_command_prints_all_problems(tmp_path):
    path = write(tmp_path, "interval: -1\nbogus: 1\n")
    result = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "check-config", path],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert f"{path}:1: interval: must be at least 0.1" in result.stderr
    assert f"{path}:2: bogus: unknown key" in result.stderr
    good = write(tmp_path, "interval: 2s\n")
    ok = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "check-config", good], capture_output=True, text=True)
    assert ok.returncode == 0 and "OK" in ok.stdout


def test_run_refuses_invalid_config_and_exits_2(tmp_path):
    path = write(tmp_path, "interval: fast\n")
    result = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "run", "--config", path],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert f"{path}:1: interval" in result.stderr
