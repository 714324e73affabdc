"""Configuration: one schema, read from defaults, a YAML file, env vars and flags, validated in one place.

The schema is the settings dataclasses: the agent's own sections below and each collector's
``Settings`` (from the collector registry). Every field has a dotted key (``collectors.nvml.enabled``):
the YAML file nests it, the env var is ``TFPROFD_`` plus the key in upper case with dots as underscores
(``TFPROFD_COLLECTORS_NVML_ENABLED``), and the flag is ``--`` plus the key (``--collectors.nvml.enabled``).
Later sources win: defaults < YAML < env < flags. Secrets have no flag. All problems are collected and
reported at once, each naming where the bad value came from (file and line, env var or flag).
"""

from __future__ import annotations

import codecs
import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tfprofd.exporter import options as opt
from tfprofd.exporter.options import option
from tfprofd.exporter.registry import COLLECTORS, signal_catalog
from tfprofd.exporter.training import HookSettings

from .client import default_state_dir
from .problems import ConfigError, Problem
from .rules import DEFAULT_RULES, Rule, parse_rules

ENV_PREFIX = "TFPROFD_"
CONFIG_ENV = "TFPROFD_CONFIG"
MAX_CONFIG_BYTES = 4 * 1024 * 1024
# Values (scalars, lists, mappings) one key may hold with its YAML aliases expanded: far above any real config,
# far below an alias bomb (nine levels of nine aliases make 387 million from a 300-byte file).
MAX_CONFIG_VALUES = 100_000


@dataclass(frozen=True)
class CoreSettings:
    listen: tuple[str, int] = option(("0.0.0.0", 9847), opt.parse_address, "Address for /metrics, /healthz and "
                                     "the landing page (read-only).", restart=True)
    log_level: str = option("info", opt.choice("debug", "info", "warning", "error"), "Log level.")
    interval: float = option(1.0, opt.parse_duration, "How often the collectors sample.", minimum=0.1,
                             maximum=3600)
    state_dir: str = option(default_state_dir(), opt.parse_str, "Directory for capture records, captures and "
                            "the API token.", restart=True)
    procfs_path: str = option("/proc", opt.parse_str, "Mount point of procfs (a seam for containers and tests).",
                              restart=True)
    sysfs_path: str = option("/sys", opt.parse_str, "Mount point of sysfs.", restart=True)


@dataclass(frozen=True)
class ApiSettings:
    listen: tuple[str, int] = option(("127.0.0.1", 9848), opt.parse_address, "Address of the control API "
                                     "(captures, Alertmanager webhook); loopback unless you change it.", restart=True)
    token: str = option("", opt.parse_str, "Bearer token the control API requires (env only, never a flag or the "
                        "config file); overrides api.token_file.", sources=frozenset({"env"}))
    token_file: str = option("", opt.parse_str, "File holding the bearer token the control API requires. Empty: "
                             "<state_dir>/api.token, generated on first start (readable by the agent's group).")
    max_body_bytes: int = option(65536, opt.parse_int, "Largest request body the control API accepts.",
                                 minimum=1024, maximum=16 * 1024 * 1024)


@dataclass(frozen=True)
class CaptureSettings:
    mode: str = option("agent", opt.choice("agent", "server"), "agent: the trace comes back over gRPC "
                       "(emit_xspace) and the agent writes it; server: the training process's profiler server "
                       "writes it into the capture directory (which that process must be able to write).")
    duration: float = option(2.0, opt.parse_duration, "How long a capture traces.", minimum=0.1, maximum=60)
    delay: float = option(0.0, opt.parse_duration, "Delay before the trace starts.", minimum=0, maximum=60)
    host_tracer_level: int = option(2, opt.parse_int, "Host (CPU) tracer level, 0-3.", minimum=0, maximum=3)
    device_tracer_level: int = option(1, opt.parse_int, "Device (GPU) tracer level, 0-1.", minimum=0, maximum=1)
    python_tracer_level: int = option(0, opt.parse_int, "Python tracer level, 0-1 (costly).", minimum=0, maximum=1)
    timeout: float = option(90.0, opt.parse_duration, "A capture's worker is killed this long after the "
                            "capture's delay and duration (5 s more on a GPU host, where a process that answered "
                            "with no trace is watched for a crash).", minimum=5, maximum=3600)
    max_per_hour: int = option(12, opt.parse_int, "At most this many captures start in any hour.", minimum=0,
                               maximum=3600)
    hold: float = option(24 * 3600.0, opt.parse_duration, "After a capture during (or just after) which a process of "
                         "the job died (TensorFlow's profiler can crash multi-worker jobs, and GPU jobs), no automatic "
                         "capture (rule, alert, baseline) of that job for this long; manual ones still run. 0 turns "
                         "this off.",
                         minimum=0, maximum=30 * 86400)
    keep: int = option(50, opt.parse_int, "Keep at most this many finished captures (oldest deleted first).",
                       minimum=1, maximum=100000)
    max_bytes: int = option(2 * 1024**3, opt.parse_int, "Keep at most this many bytes of captures (oldest "
                            "deleted first).", minimum=1 << 20, maximum=1 << 50)
    max_trace_bytes: int = option(256 * 1024**2, opt.parse_int, "Largest trace a profiler server may send back "
                                  "in agent mode; a larger answer fails the capture.", minimum=1 << 20,
                                  maximum=1 << 30)
    analyze: bool = option(True, opt.parse_bool, "Analyse each capture (in a worker process) after it finishes.")
    analysis_timeout: float = option(180.0, opt.parse_duration, "An analysis worker is killed this long after it "
                                     "starts (time waiting for a free worker not counted).", minimum=10, maximum=3600)
    analysis_queue_timeout: float = option(3600.0, opt.parse_duration, "A capture waits at most this long for a free "
                                           "analysis worker (two run at once); past it the capture ends "
                                           "analysis_failed (analysis_queued).", minimum=10, maximum=7 * 86400)
    analysis_max_memory: int = option(0, opt.parse_int, "Most memory (bytes) one analysis worker may need, "
                                      "estimated from the trace before xprof starts; a larger trace ends "
                                      "analysis_failed (too_large). 0: a quarter of the memory the agent may use "
                                      "(the host's, or its cgroup's limit where lower). With a memory limit, set "
                                      "it to under half the limit less the agent's 64 MiB (two analyses run at "
                                      "once).", minimum=0, maximum=1 << 40)
    baseline: bool = option(True, opt.parse_bool, "Take a short baseline capture of each job once it trains steadily, "
                            "and compare every later capture of the job with it.")
    baseline_after: float = option(300.0, opt.parse_duration, "A job trains steadily (no rule firing for it) this long "
                                   "before its baseline is captured.", minimum=10, maximum=7 * 86400)
    baseline_every: float = option(6 * 3600.0, opt.parse_duration, "At most one baseline capture per job in this time "
                                   "(with baseline_duration, at most 2 s per hour per job).", minimum=3600,
                                   maximum=30 * 86400)
    baseline_duration: float = option(1.0, opt.parse_duration, "How long a baseline capture traces.", minimum=0.1,
                                      maximum=2)
    on_pending: bool = option(True, opt.parse_bool, "Start a rule's capture when the rule goes pending, not when it "
                              "fires: the trace then holds the start of a slowdown; kept only if the rule fires, "
                              "else discarded (it still counts against max_per_hour and the rule's cooldown).")
    snapshots: bool = option(True, opt.parse_bool, "With on_pending, in agent mode: arm TensorFlow's continuous "
                             "profiling while the rule is pending and keep a ring of snapshots (TensorFlow 2.21+; "
                             "older servers fall back to one capture at pending).")
    snapshot_interval: float = option(2.0, opt.parse_duration, "How often an armed job's profile is snapshotted "
                                      "into the ring.", minimum=0.5, maximum=60)
    snapshot_keep: int = option(8, opt.parse_int, "Snapshots the ring holds (oldest dropped first).", minimum=1,
                                maximum=64)
    snapshot_max_bytes: int = option(64 * 1024**2, opt.parse_int, "Bytes the ring holds (oldest snapshots dropped "
                                     "first).", minimum=1 << 20, maximum=1 << 30)
    dir_mode: int = option(0o770, opt.parse_dir_mode, "Mode of a capture directory in server mode, where the "
                           "training process writes into it (never world-writable; agent mode uses 0750).",
                           raw_text=True)


@dataclass(frozen=True)
class AlertSettings:
    host_label: str = option("instance", opt.parse_str, "Alert label naming the host an Alertmanager alert is "
                             "about.")
    host_value: str = option("", opt.parse_str, "This host's value of that label (empty: the host name); "
                             "host:port values match on host.")
    forward_networks: tuple[Any, ...] = option((), opt.parse_networks, "Forward an alert for another host to that "
                                               "host's agent when the host part of its forward_label is an IP "
                                               "address in these networks (e.g. the nodes' CIDR); empty: never "
                                               "forward. All agents must share one API token.")
    forward_label: str = option("instance", opt.parse_str, "Alert label whose host part addresses the agent an "
                                "alert for another host is forwarded to.")
    forward_port: int = option(0, opt.parse_int, "Control API port of the agents alerts are forwarded to (0: this "
                               "agent's own api.listen port).", minimum=0, maximum=65535)
    forward_timeout: float = option(5.0, opt.parse_duration, "How long forwarding one batch of alerts may take.",
                                    minimum=0.1, maximum=60)


@dataclass(frozen=True)
class ClusterSettings:
    prometheus_url: str = option("", opt.parse_http_url, "Prometheus that scrapes the agents: where the workers of "
                                 "a job on other hosts are found (their tfprofd_training_up). Empty: none.")
    peers: tuple[tuple[str, int], ...] = option((), opt.parse_peers, "Control API host:port of other agents, for "
                                                "hosts without Prometheus (trusted as named).")
    timeout: float = option(2.0, opt.parse_duration, "How long the Prometheus query for a job's agents may take.",
                            minimum=0.1, maximum=60)


AGENT_SECTIONS: dict[str, type] = {"": CoreSettings, "api": ApiSettings, "captures": CaptureSettings,
                                   "alerts": AlertSettings, "cluster": ClusterSettings}
SECTIONS: dict[str, type] = {**AGENT_SECTIONS, **{cls.section: cls.Settings for cls in COLLECTORS.values()}}


@dataclass(frozen=True)
class Option:
    key: str
    section: str
    field: dataclasses.Field

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper().replace(".", "_")

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def meta(self) -> Mapping[str, Any]:
        return self.field.metadata

    def show_default(self) -> str:
        value = self.field.default
        if value is None:
            return "off"
        if isinstance(value, bool):
            return str(value).lower()
        if self.meta["parse"] is opt.parse_duration:
            return opt.format_duration(value)
        if value == "":
            return "none"
        if isinstance(value, tuple) and len(value) == 2:  # an address
            return f"{value[0]}:{value[1]}"
        if isinstance(value, tuple):  # a list
            return ",".join(map(str, value)) or "none"
        if isinstance(value, re.Pattern):
            return value.pattern
        if self.meta.get("raw_text"):
            return f"0{value:o}"
        return str(value)


OPTIONS: tuple[Option, ...] = tuple(
    Option(f"{prefix}.{f.name}" if prefix else f.name, prefix, f)
    for prefix, cls in SECTIONS.items() for f in opt.fields(cls))
OPTIONS_BY_KEY: dict[str, Option] = {o.key: o for o in OPTIONS}
_SECTION_PREFIXES = frozenset(p for prefix in SECTIONS if prefix
                              for p in (".".join(prefix.split(".")[:i]) for i in range(1, prefix.count(".") + 2)))


@dataclass(frozen=True)
class Config:
    """A validated configuration: one typed settings object per section."""

    core: CoreSettings
    api: ApiSettings
    captures: CaptureSettings
    alerts: AlertSettings
    cluster: ClusterSettings
    collectors: Mapping[str, Any]  # collector name -> its Settings
    rules: tuple[Rule, ...]
    path: str | None = None

    @property
    def hook(self) -> HookSettings:
        return self.collectors["training"]

    def section(self, prefix: str) -> Any:
        attr = {"": "core"}.get(prefix, prefix)
        if attr in ("core", "api", "captures", "alerts", "cluster"):
            return getattr(self, attr)
        return next(self.collectors[name] for name, cls in COLLECTORS.items() if cls.section == prefix)

    def value(self, key: str) -> Any:
        option = OPTIONS_BY_KEY[key]
        return getattr(self.section(option.section), option.field.name)


@dataclass(frozen=True)
class Located:
    value: Any
    source: str


# ---- the YAML file, with line numbers ----


def _decode(data: bytes, path: str, problems: list[Problem]) -> str | None:
    """The file's text (UTF-8, or UTF-16/32 with a byte-order mark), or None with the reason."""
    boms = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
            (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
    encoding = next((name for bom, name in boms if data.startswith(bom)), "utf-8")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        problems.append(Problem(f"{path}:{line}", "(file)", f"not {encoding.upper()} text: byte "
                                f"0x{data[exc.start]:02x} at offset {exc.start} cannot be decoded"))
        return None


_CYCLE = -1


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values ``node`` holds with every alias expanded, counted up to just past MAX_CONFIG_VALUES;
    ``_CYCLE`` if an alias refers to a node that contains it. ``sizes`` remembers shared (aliased) nodes."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    if isinstance(node, yaml.ScalarNode):
        return 1
    sizes[id(node)] = _CYCLE  # until its children are counted: meeting it again means a cycle
    total = 1
    children = (n for pair in node.value for n in pair) if isinstance(node, yaml.MappingNode) else iter(node.value)
    for child in children:
        size = _expanded_size(child, sizes)
        if size == _CYCLE:
            return _CYCLE
        total = min(total + size, MAX_CONFIG_VALUES + 1)
    sizes[id(node)] = total
    return total


def _too_big(node: yaml.Node, sizes: dict[int, int]) -> str | None:
    """Why ``node`` must not be constructed (an alias bomb or a self-referring alias), or None."""
    size = _expanded_size(node, sizes)
    if size == _CYCLE:
        return "an alias in this value refers to the value itself"
    if size > MAX_CONFIG_VALUES:
        return f"holds more than {MAX_CONFIG_VALUES} values once its aliases are expanded (an alias bomb?)"
    return None


def _flatten(loader: yaml.SafeLoader, node: yaml.Node, path: str, prefix: str, out: dict[str, Located],
             problems: list[Problem], sizes: dict[int, int]) -> None:
    if not isinstance(node, yaml.MappingNode):
        where = f"{path}:{node.start_mark.line + 1}"
        problems.append(Problem(where, prefix.rstrip(".") or "(top level)", "expected a mapping of keys to values"))
        return
    seen: set[str] = set()
    for key_node, value_node in node.value:
        where = f"{path}:{key_node.start_mark.line + 1}"
        key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else f"<{key_node.tag}>"
        dotted = f"{prefix}{key}"
        if dotted in seen:
            problems.append(Problem(where, dotted, "duplicate key"))
            continue
        seen.add(dotted)
        option = OPTIONS_BY_KEY.get(dotted)
        if (dotted == "rules" or option is not None) and (why := _too_big(value_node, sizes)):
            problems.append(Problem(where, dotted, why))
        elif dotted == "rules":
            out["rules"] = Located(parse_rules(loader, value_node, path, signal_catalog(), problems), where)
        elif option is not None:
            if "yaml" not in option.meta["sources"]:
                problems.append(Problem(where, dotted, f"not read from the config file (a secret): set env "
                                                       f"{option.env} instead"))
            elif option.meta["raw_text"] and isinstance(value_node, yaml.ScalarNode):
                out[dotted] = Located(value_node.value, where)
            else:
                out[dotted] = Located(loader.construct_object(value_node, deep=True), where)
        elif dotted in _SECTION_PREFIXES:
            _flatten(loader, value_node, path, dotted + ".", out, problems, sizes)
        else:
            import difflib  # on a bad key only: 0.1 MB of resident memory otherwise

            close = difflib.get_close_matches(dotted, [*OPTIONS_BY_KEY, "rules"], n=1, cutoff=0.75)
            problems.append(Problem(where, opt.shown(dotted)[1:-1], "unknown key"
                                    + (f" (did you mean {close[0]!r}?)" if close else "")))


def read_yaml(path: str, problems: list[Problem]) -> dict[str, Located]:
    """Flatten a YAML config file into dotted keys, each with its ``file:line``; never raises."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        problems.append(Problem(path, "(file)", f"cannot read: {exc.strerror or exc}"))
        return {}
    if len(data) > MAX_CONFIG_BYTES:
        problems.append(Problem(path, "(file)", f"larger than {MAX_CONFIG_BYTES} bytes: not a config file"))
        return {}
    text = _decode(data, path, problems)
    if text is None:
        return {}
    out: dict[str, Located] = {}
    loader = None
    try:
        loader = yaml.SafeLoader(text)
        node = loader.get_single_node()
        if node is not None:
            _flatten(loader, node, path, "", out, problems, {})
    except yaml.reader.ReaderError as exc:
        line = text[:exc.position].count("\n") + 1
        problems.append(Problem(f"{path}:{line}", "(syntax)",
                                f"character #x{exc.character:04x} is not allowed in YAML"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        problems.append(Problem(where, "(syntax)", f"invalid YAML: {getattr(exc, 'problem', None) or exc}"))
    except RecursionError:
        problems.append(Problem(path, "(syntax)", "nested too deeply to be a config file"))
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. a timestamp-looking value that is no date
        problems.append(Problem(path, "(syntax)", f"invalid value: {exc}"))
    finally:
        if loader is not None:
            loader.dispose()
    return out


# ---- putting it together ----


def _number(value: float) -> str:
    """A number for a message: ``{:g}``, or cut short where it has no float (an integer of 400 digits)."""
    try:
        return f"{value:g}"
    except OverflowError:
        return opt.shown(value)


def _validate(option: Option, located: Located, problems: list[Problem]) -> Any:
    try:
        value = option.meta["parse"](located.value)
    except ValueError as exc:
        problems.append(Problem(located.source, option.key, str(exc)))
        return option.field.default
    low, high = option.meta["min"], option.meta["max"]
    if low is not None and value < low:
        problems.append(Problem(located.source, option.key, f"must be at least {low:g}, got {_number(value)}"))
    if high is not None and value > high:
        problems.append(Problem(located.source, option.key, f"must be at most {high:g}, got {_number(value)}"))
    return value


def load(path: str | None = None, env: Mapping[str, str] | None = None,
         flags: Mapping[str, Any] | None = None) -> Config:
    """Build and validate a Config; raise ConfigError listing every problem."""
    env = os.environ if env is None else env
    flags = flags or {}
    problems: list[Problem] = []
    raw: dict[str, Located] = read_yaml(path, problems) if path else {}
    for entry in OPTIONS:
        if entry.env in env and "env" in entry.meta["sources"]:
            raw[entry.key] = Located(env[entry.env], f"env {entry.env}")
        if flags.get(entry.key) is not None and "flag" in entry.meta["sources"]:
            raw[entry.key] = Located(flags[entry.key], f"flag {entry.flag}")
    values = {key: _validate(OPTIONS_BY_KEY[key], located, problems)
              for key, located in raw.items() if key in OPTIONS_BY_KEY}
    sections = {prefix: cls(**{f.name: values[k] for f in opt.fields(cls)
                               if (k := f"{prefix}.{f.name}" if prefix else f.name) in values})
                for prefix, cls in SECTIONS.items()}
    if "rules" in raw:
        rules = raw["rules"].value
    else:
        rules = load_rules_file(DEFAULT_RULES, problems)
    core, api = sections[""], sections["api"]
    if not problems and core.listen == api.listen and core.listen[1] != 0:
        problems.append(Problem(raw.get("api.listen", Located(None, "default")).source, "api.listen",
                                "must differ from listen: /metrics and the control API are separate listeners"))
    if problems:
        raise ConfigError(problems)
    return Config(core=core, api=api, captures=sections["captures"], alerts=sections["alerts"],
                  cluster=sections["cluster"],
                  collectors={name: sections[cls.section] for name, cls in COLLECTORS.items()},
                  rules=tuple(rules), path=path)


def load_rules_file(path: Path, problems: list[Problem]) -> list[Rule]:
    loader = yaml.SafeLoader(path.read_text())
    try:
        root = loader.get_single_node()
        node = next((v for k, v in root.value if k.value == "rules"), None) if root else None
        return parse_rules(loader, node, str(path), signal_catalog(), problems) if node is not None else []
    finally:
        loader.dispose()


def keep_restart_only(new: Config, running: Config) -> tuple[Config, list[str]]:
    """``new`` with every restart-only option that changed set back to its running value, and those keys."""
    changed: list[str] = []
    replaced: dict[str, Any] = {}
    for prefix in SECTIONS:
        section, current = new.section(prefix), running.section(prefix)
        kept = {f.name: getattr(current, f.name) for f in opt.fields(type(section))
                if f.metadata["restart"] and getattr(section, f.name) != getattr(current, f.name)}
        changed += [f"{prefix}.{name}" if prefix else name for name in kept]
        if kept:
            replaced[prefix] = dataclasses.replace(section, **kept)
    if not replaced:
        return new, changed
    collectors = {name: replaced.get(cls.section, new.collectors[name]) for name, cls in COLLECTORS.items()}
    return dataclasses.replace(new, core=replaced.get("", new.core), api=replaced.get("api", new.api),
                               captures=replaced.get("captures", new.captures),
                               alerts=replaced.get("alerts", new.alerts), cluster=replaced.get("cluster", new.cluster),
                               collectors=collectors), changed
