"""Option declarations: every configurable part (the agent's sections, each collector) declares its
options as fields of a frozen dataclass made with ``option()``; the agent's config reads them from there.

A field carries its parser, help text, bounds and where it may come from. Parsers take a raw value
(YAML-typed, or a string from env or a flag) and return the typed value or raise ValueError with a
message a user can act on.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
import reprlib
import urllib.parse
from collections.abc import Callable
from typing import Any

# Where a value may come from; secrets leave out "flag" so they never appear in argv (ps).
ALL_SOURCES = frozenset({"yaml", "env", "flag"})


def option(default: Any, parse: Callable[[Any], Any], help: str, *, minimum: float | None = None,
           maximum: float | None = None, restart: bool = False, sources: frozenset[str] = ALL_SOURCES,
           raw_text: bool = False) -> Any:
    """A dataclass field that is also a config option.

    ``restart``: a reload keeps the running value (it takes effect after a restart). ``raw_text``: the
    parser gets the YAML scalar as written (``0770`` stays octal text, not the integer YAML made of it).
    """
    return dataclasses.field(default=default, metadata={
        "parse": parse, "help": help, "min": minimum, "max": maximum, "restart": restart, "sources": sources,
        "raw_text": raw_text})


class _Short(reprlib.Repr):
    """reprlib's cut-short repr, also for an integer too long for ``repr`` (over 4300 digits)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxdict, self.maxset = 3, 6, 6, 6, 6
        self.maxstring, self.maxlong, self.maxother = 60, 40, 60

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 256:
            return f"<an integer of about {len(hex(x)) * 6 // 5} digits>"
        return super().repr_int(x, level)


_SHORT = _Short()


def shown(value: Any) -> str:
    """``repr(value)`` cut short for a message: a value may be huge (a 4 MB string, an expanded YAML alias)."""
    return _SHORT.repr(value)


def _finite(value: float, what: str) -> float:
    if not math.isfinite(value):
        raise ValueError(f"expected a finite {what}, got {shown(value)}")
    return value


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(raw: Any) -> float:
    """Non-negative seconds from ``1.5`` or ``"500ms"``, ``"10s"``, ``"5m"``, ``"1h"``."""
    if isinstance(raw, bool):
        raise ValueError("expected a duration like 1s, 500ms or 5m")
    if isinstance(raw, (int, float)):
        value = _finite(float(raw), "duration")
        if value < 0:
            raise ValueError(f"expected a duration of 0 or more, got {shown(raw)}")
        return value
    match = _DURATION.match(str(raw)) if isinstance(raw, str) else None
    if not match:
        raise ValueError(f"expected a duration like 1s, 500ms or 5m, got {shown(raw)}")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def format_duration(seconds: float) -> str:
    """A duration as a user writes it (``24h``, ``5m``, ``90s``, ``500ms``): what parse_duration reads back."""
    if seconds == 0:
        return "0s"
    for unit, size in (("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= size and (seconds / size).is_integer():
            return f"{int(seconds / size)}{unit}"
    millis = seconds * 1000
    return f"{round(millis)}ms" if math.isclose(millis, round(millis)) else f"{seconds:g}s"


def parse_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower() if isinstance(raw, (str, int)) else ""
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {shown(raw)}")


def parse_int(raw: Any) -> int:
    if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()) or isinstance(raw, (list, dict)):
        raise ValueError(f"expected an integer, got {shown(raw)}")
    try:
        return int(raw)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"expected an integer, got {shown(raw)}") from None


def parse_float(raw: Any) -> float:
    if isinstance(raw, (bool, list, dict)):
        raise ValueError(f"expected a number, got {shown(raw)}")
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number, got {shown(raw)}") from None
    return _finite(value, "number")


def parse_str(raw: Any) -> str:
    if isinstance(raw, (dict, list)):
        raise ValueError(f"expected a string, got a {type(raw).__name__}")
    text = "" if raw is None else str(raw)
    if "\0" in text:
        raise ValueError("a NUL character is not allowed in a value")
    return text


def parse_host(text: str) -> str:
    """An IP address or a DNS host name; raises ValueError otherwise."""
    host = text.strip("[]")
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if not re.fullmatch(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}))*\.?",
                        host):
        raise ValueError(f"expected an IP address or host name, got {shown(text)}")
    return host


def parse_address(raw: Any) -> tuple[str, int]:
    """``host:port``, ``:port`` (all interfaces) or ``[v6]:port`` → (host, port)."""
    text = parse_str(raw).strip()
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ValueError(f"expected host:port, got {shown(text)}")
    if not port_text.isdigit():
        raise ValueError(f"expected host:port with a numeric port, got {shown(text)}")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be 0..65535, got {port}")
    return (parse_host(host) if host else "0.0.0.0"), port


def parse_optional_address(raw: Any) -> tuple[str, int] | None:
    """Like parse_address; an empty value turns the listener off."""
    return parse_address(raw) if parse_str(raw).strip() else None


def parse_peers(raw: Any) -> tuple[tuple[str, int], ...]:
    """``host:port`` addresses of other agents from a YAML list or a comma-separated string; empty: none."""
    items = raw if isinstance(raw, list) else [] if raw is None else parse_str(raw).split(",")
    peers = []
    for item in items:
        text = parse_str(item).strip()
        if not text:
            continue
        host, port = parse_address(text)
        if text.startswith(":") or port == 0:
            raise ValueError(f"expected host:port of an agent's control API, got {shown(text)}")
        if (host, port) not in peers:
            peers.append((host, port))
    return tuple(peers)


def parse_http_url(raw: Any) -> str:
    """An http(s) URL with a host, without credentials, query or fragment (trailing / removed); empty: off."""
    text = parse_str(raw).strip()
    if not text:
        return ""
    url = urllib.parse.urlsplit(text)
    if url.scheme not in ("http", "https") or not url.hostname or url.username or url.query or url.fragment:
        raise ValueError(f"expected an http:// or https:// URL like http://prometheus:9090, got {shown(text)}")
    try:
        url.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"bad port in {shown(text)}: {exc}") from None
    return text.rstrip("/")


def parse_networks(raw: Any) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """IP networks (``10.0.0.0/16``) from a YAML list or a comma-separated string; empty means none."""
    items = raw if isinstance(raw, list) else [] if raw is None else parse_str(raw).split(",")
    networks = []
    for item in items:
        text = parse_str(item).strip()
        if not text:
            continue
        try:
            networks.append(ipaddress.ip_network(text, strict=False))
        except ValueError:
            raise ValueError(f"expected IP networks like 10.0.0.0/16, got {shown(text)}") from None
    return tuple(networks)


def parse_regex(raw: Any) -> re.Pattern[str]:
    text = parse_str(raw)
    try:
        return re.compile(text)
    except (re.error, RecursionError, OverflowError) as exc:
        raise ValueError(f"invalid regular expression {shown(text)}: {exc}") from None


def choice(*choices: str) -> Callable[[Any], str]:
    def parse(raw: Any) -> str:
        text = parse_str(raw).lower()
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {shown(raw)}")
        return text

    return parse


def parse_dir_mode(raw: Any) -> int:
    """A directory mode written in octal, as for chmod (``0750``, ``750``, ``0o750``).

    Never world-writable, and no setuid, setgid or sticky bit: a setgid state directory passes its
    group on to new directories by itself, and systemd's RestrictSUIDSGID refuses setting those bits.
    """
    text = parse_str(raw).strip().lower().removeprefix("0o")
    if isinstance(raw, int) and not isinstance(raw, bool):
        raise ValueError(f"write the mode in octal as a string, e.g. \"0750\" (got the number {shown(raw)})")
    if not re.fullmatch(r"[0-7]{1,4}", text):
        raise ValueError(f"expected an octal mode like 0750, got {shown(raw)}")
    value = int(text, 8)
    if value & ~0o777:
        raise ValueError(f"setuid, setgid and sticky bits are not allowed, got {shown(raw)}")
    if value & 0o002:
        raise ValueError(f"a world-writable mode is not allowed, got {shown(raw)}")
    return value


def fields(settings_class: type) -> list[dataclasses.Field]:
    """The option fields of a settings dataclass, in declaration order."""
    return [f for f in dataclasses.fields(settings_class) if "parse" in f.metadata]
