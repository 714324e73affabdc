"""Configuration: one schema, read from defaults, a YAML file, env vars and flags, validated in one place.

Every option has a dotted key (``collectors.nvml.enabled``). The YAML file nests it, the env var is
``TFPROFD_`` plus the key in upper case with dots as underscores (``TFPROFD_COLLECTORS_NVML_ENABLED``),
and the flag is ``--`` plus the key (``--collectors.nvml.enabled``). Later sources win:
defaults < YAML < env < flags. All problems are collected and reported at once, each naming where the
bad value came from (file and line, env var or flag) and what was expected.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ENV_PREFIX = "TFPROFD_"
CONFIG_ENV = "TFPROFD_CONFIG"
DEFAULT_LISTEN = ":9847"
DEFAULT_API_LISTEN = "127.0.0.1:9848"
DEFAULT_HOOK_ADDR = "127.0.0.1:9847"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the configuration, and where it came from."""

    source: str  # "path/to/file.yaml:12", "env TFPROFD_X", "flag --x"
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.source}: {self.key}: {self.message}"


class ConfigError(Exception):
    """Raised with every problem found, so a user fixes them all in one go."""

    def __init__(self, problems: list[Problem]):
        self.problems = sorted(problems, key=_source_order)
        super().__init__("\n".join(str(p) for p in problems))


def _source_order(problem: Problem) -> tuple[str, int, str]:
    name, _, line = problem.source.rpartition(":")
    return (name, int(line), problem.key) if line.isdigit() else (problem.source, 0, problem.key)


# ---- value types: each parses a raw value (YAML-typed or a string) or raises ValueError ----

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(raw: Any) -> float:
    """Seconds from ``1.5`` or ``"500ms"``, ``"10s"``, ``"5m"``, ``"1h"``."""
    if isinstance(raw, bool):
        raise ValueError("expected a duration like 1s, 500ms or 5m")
    if isinstance(raw, (int, float)):
        return float(raw)
    match = _DURATION.match(str(raw))
    if not match:
        raise ValueError(f"expected a duration like 1s, 500ms or 5m, got {raw!r}")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def parse_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {raw!r}")


def parse_int(raw: Any) -> int:
    if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
        raise ValueError(f"expected an integer, got {raw!r}")
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"expected an integer, got {raw!r}") from None


def parse_float(raw: Any) -> float:
    if isinstance(raw, bool):
        raise ValueError(f"expected a number, got {raw!r}")
    try:
        return float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number, got {raw!r}") from None


def parse_str(raw: Any) -> str:
    if isinstance(raw, (dict, list)):
        raise ValueError(f"expected a string, got a {type(raw).__name__}")
    return "" if raw is None else str(raw)


def parse_address(raw: Any) -> tuple[str, int]:
    """``host:port``, ``:port`` (all interfaces) or ``[v6]:port`` → (host, port)."""
    text = parse_str(raw).strip()
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ValueError(f"expected host:port, got {text!r}")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"expected host:port with a numeric port, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be 0..65535, got {port}")
    if host:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not re.fullmatch(r"[A-Za-z0-9.-]+", host):
                raise ValueError(f"expected an IP address or host name, got {host!r}") from None
    return host or "0.0.0.0", port


def parse_regex(raw: Any) -> re.Pattern[str]:
    text = parse_str(raw)
    try:
        return re.compile(text)
    except re.error as exc:
        raise ValueError(f"invalid regular expression {text!r}: {exc}") from None


def _choice(*choices: str) -> Callable[[Any], str]:
    def parse(raw: Any) -> str:
        text = parse_str(raw).lower()
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {raw!r}")
        return text

    return parse


@dataclass(frozen=True)
class Option:
    key: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    minimum: float | None = None
    maximum: float | None = None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper().replace(".", "_")

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


def parse_mode(raw: Any) -> int:
    """File mode from an octal string (``"0770"``) or an int."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    else:
        try:
            value = int(parse_str(raw), 8)
        except ValueError:
            raise ValueError(f"expected an octal file mode like 0770, got {raw!r}") from None
    if not 0 <= value <= 0o7777:
        raise ValueError(f"expected an octal file mode like 0770, got {raw!r}")
    return value


def _default_state_dir() -> str:
    if os.geteuid() == 0:
        return "/var/lib/tfprofd"
    return str(Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local/state")) / "tfprofd")


_DEFAULT_NET_EXCLUDE = r"^(lo|veth.*|cali.*|flannel.*|cni.*|docker\d+|br-.*|virbr.*)$"
_DEFAULT_DISK_EXCLUDE = r"^(z?ram|loop|fd|(h|s|v|xv)d[a-z]|nvme\d+n\d+p)\d+$"

OPTIONS: tuple[Option, ...] = (
    Option("listen", parse_address, DEFAULT_LISTEN,
           "Address for /metrics, /healthz and the landing page (read-only)."),
    Option("log_level", _choice("debug", "info", "warning", "error"), "info", "Log level."),
    Option("interval", parse_duration, 1.0, "How often the collectors sample.", 0.1, 3600),
    Option("state_dir", parse_str, _default_state_dir(), "Directory for capture records and captures."),
    Option("procfs_path", parse_str, "/proc", "Mount point of procfs (a seam for containers and tests)."),
    Option("sysfs_path", parse_str, "/sys", "Mount point of sysfs."),
    Option("api.listen", parse_address, DEFAULT_API_LISTEN,
           "Address of the control API (captures, Alertmanager webhook); loopback unless you change it."),
    Option("api.token", parse_str, "", "Bearer token required by the control API; empty means none."),
    Option("api.token_file", parse_str, "", "File holding the bearer token (overrides api.token)."),
    Option("api.max_body_bytes", parse_int, 65536, "Largest request body the control API accepts.", 1024,
           16 * 1024 * 1024),
    Option("collectors.nvml.enabled", parse_bool, True, "Export GPU metrics through NVML."),
    Option("collectors.nvml.pcie_interval", parse_duration, 10.0,
           "How often to sample PCIe throughput (each read costs ~20 ms per GPU and direction).", 1, 3600),
    Option("collectors.nvml.retry_interval", parse_duration, 60.0,
           "How often to retry NVML initialization when no driver was found.", 1, 86400),
    Option("collectors.cpu.enabled", parse_bool, True, "Export CPU time, utilization, load and pressure."),
    Option("collectors.memory.enabled", parse_bool, True, "Export host memory and memory pressure."),
    Option("collectors.disk.enabled", parse_bool, True, "Export per-disk I/O and I/O pressure."),
    Option("collectors.disk.device_exclude", parse_regex, _DEFAULT_DISK_EXCLUDE,
           "Disks to skip (partitions and loop devices by default, as node_exporter)."),
    Option("collectors.network.enabled", parse_bool, True, "Export per-interface network traffic."),
    Option("collectors.network.device_exclude", parse_regex, _DEFAULT_NET_EXCLUDE,
           "Interfaces to skip (loopback and container veths by default)."),
    Option("collectors.training.enabled", parse_bool, True, "Receive reports from the training hook."),
    Option("collectors.training.down_after", parse_duration, 30.0,
           "A job that has not reported for this long is marked down (tfprofd_training_up 0).", 1, 86400),
    Option("collectors.training.expire_after", parse_duration, 600.0,
           "A job that has not reported for this long has its series removed.", 1, 7 * 86400),
    Option("hook.listen", parse_address, DEFAULT_HOOK_ADDR,
           "UDP address where the training hook sends its reports (env TFPROFD_ADDR in the training process)."),
    Option("captures.mode", _choice("server", "agent"), "server",
           "server: the training process's profiler server writes the trace into the capture directory "
           "(it must be writable by that process); agent: the trace comes back over gRPC (emit_xspace) and "
           "the agent writes it."),
    Option("captures.duration", parse_duration, 2.0, "How long a capture traces.", 0.1, 60),
    Option("captures.delay", parse_duration, 0.0, "Delay before the trace starts.", 0, 60),
    Option("captures.host_tracer_level", parse_int, 2, "Host (CPU) tracer level, 0-3.", 0, 3),
    Option("captures.device_tracer_level", parse_int, 1, "Device (GPU) tracer level, 0-1.", 0, 1),
    Option("captures.python_tracer_level", parse_int, 0, "Python tracer level, 0-1 (costly).", 0, 1),
    Option("captures.timeout", parse_duration, 90.0,
           "A capture's worker is killed this long after the capture's duration.", 5, 3600),
    Option("captures.max_per_hour", parse_int, 12, "At most this many captures start in any hour.", 0, 3600),
    Option("captures.keep", parse_int, 50, "Keep at most this many finished captures (oldest deleted first).",
           1, 100000),
    Option("captures.max_bytes", parse_int, 2 * 1024**3,
           "Keep at most this many bytes of captures (oldest deleted first).", 1 << 20, 1 << 50),
    Option("captures.analyze", parse_bool, True, "Analyse each capture (in a worker process) after it finishes."),
    Option("captures.analysis_timeout", parse_duration, 180.0, "An analysis worker is killed after this long.",
           10, 3600),
    Option("captures.dir_mode", parse_mode, 0o777,
           "Mode of a capture's directory while the profiler server writes into it."),
    Option("alerts.host_label", parse_str, "instance",
           "Alert label naming the host an Alertmanager alert is about."),
    Option("alerts.host_value", parse_str, "",
           "This host's value of that label (empty: the host name); host:port values match on host."),
    Option("hook.max_datagram_bytes", parse_int, 8192, "Largest hook report accepted; larger ones are rejected.",
           512, 65507),
)

OPTIONS_BY_KEY: dict[str, Option] = {o.key: o for o in OPTIONS}
SECTIONS = frozenset(k.rsplit(".", 1)[0] for k in OPTIONS_BY_KEY if "." in k) | frozenset(
    k.split(".", 1)[0] for k in OPTIONS_BY_KEY if "." in k
)


@dataclass
class Config:
    """A validated configuration. Look values up by dotted key: ``cfg["collectors.nvml.enabled"]``."""

    values: dict[str, Any]
    path: str | None = None
    rules: list[Any] = field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        return self.values[key]


@dataclass(frozen=True)
class Located:
    value: Any
    source: str


# ---- the YAML file, with line numbers ----


def _construct(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    return loader.construct_object(node, deep=True)


def _flatten(
    loader: yaml.SafeLoader, node: yaml.Node, path: str, prefix: str, out: dict[str, Located],
    sections: Mapping[str, Callable[..., Any]], problems: list[Problem],
) -> None:
    if not isinstance(node, yaml.MappingNode):
        where = f"{path}:{node.start_mark.line + 1}"
        problems.append(Problem(where, prefix or "(top level)", "expected a mapping of keys to values"))
        return
    seen: set[str] = set()
    for key_node, value_node in node.value:
        where = f"{path}:{key_node.start_mark.line + 1}"
        key = str(_construct(loader, key_node))
        dotted = f"{prefix}{key}"
        if dotted in seen:
            problems.append(Problem(where, dotted, "duplicate key"))
            continue
        seen.add(dotted)
        if dotted in sections:
            sections[dotted](loader, value_node, path, out, problems)
        elif dotted in OPTIONS_BY_KEY:
            out[dotted] = Located(_construct(loader, value_node), where)
        elif dotted in SECTIONS:
            _flatten(loader, value_node, path, dotted + ".", out, sections, problems)
        else:
            problems.append(Problem(where, dotted, f"unknown key{_suggest(dotted)}"))


def _suggest(key: str) -> str:
    import difflib

    close = difflib.get_close_matches(key, [*OPTIONS_BY_KEY, *SECTION_PARSERS], n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _rules_section(loader: yaml.SafeLoader, node: yaml.Node, path: str, out: dict[str, Located],
                   problems: list[Problem]) -> None:
    from .rules import parse_rules

    out["rules"] = Located(parse_rules(loader, node, path, problems), f"{path}:{node.start_mark.line + 1}")


# Structured sections (lists of records): (loader, node, path, out, problems).
SECTION_PARSERS: dict[str, Callable[..., Any]] = {"rules": _rules_section}


def read_yaml(path: str, problems: list[Problem]) -> dict[str, Located]:
    """Flatten a YAML config file into dotted keys, each with its ``file:line``."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        problems.append(Problem(path, "(file)", f"cannot read: {exc.strerror or exc}"))
        return {}
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        problems.append(Problem(where, "(syntax)", f"invalid YAML: {getattr(exc, 'problem', None) or exc}"))
        return {}
    out: dict[str, Located] = {}
    try:
        if node is not None:
            _flatten(loader, node, path, "", out, SECTION_PARSERS, problems)
    except yaml.YAMLError as exc:
        problems.append(Problem(path, "(syntax)", f"invalid YAML: {exc}"))
    finally:
        loader.dispose()
    return out


# ---- putting it together ----


def _validate(option: Option, located: Located, problems: list[Problem]) -> Any:
    try:
        value = option.parse(located.value)
    except ValueError as exc:
        problems.append(Problem(located.source, option.key, str(exc)))
        return None
    if option.minimum is not None and value < option.minimum:
        problems.append(Problem(located.source, option.key, f"must be at least {option.minimum:g}, got {value:g}"))
    if option.maximum is not None and value > option.maximum:
        problems.append(Problem(located.source, option.key, f"must be at most {option.maximum:g}, got {value:g}"))
    return value


def load(
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Config:
    """Build and validate a Config; raise ConfigError listing every problem."""
    env = os.environ if env is None else env
    flags = flags or {}
    problems: list[Problem] = []
    raw: dict[str, Located] = {o.key: Located(o.default, "default") for o in OPTIONS}
    if path:
        raw.update(read_yaml(path, problems))
    for option in OPTIONS:
        if option.env in env:
            raw[option.key] = Located(env[option.env], f"env {option.env}")
        if flags.get(option.key) is not None:
            raw[option.key] = Located(flags[option.key], f"flag {option.flag}")
    values = {key: _validate(OPTIONS_BY_KEY[key], loc, problems) for key, loc in raw.items()
              if key in OPTIONS_BY_KEY}
    if "rules" in raw:
        rules = raw["rules"].value
    else:
        from .rules import DEFAULT_RULES, load_rules_file

        rules = load_rules_file(DEFAULT_RULES, problems)
    if not problems and values["listen"] == values["api.listen"] and values["listen"][1] != 0:
        problems.append(Problem(raw["api.listen"].source, "api.listen",
                                "must differ from listen: /metrics and the control API are separate listeners"))
    if problems:
        raise ConfigError(problems)
    return Config(values=values, path=path, rules=rules)
