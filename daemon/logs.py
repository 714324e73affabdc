"""Logging in logfmt (``ts=... level=... msg="..."``), the format node_exporter and journald users read."""

from __future__ import annotations

import logging
import sys
import time


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        message = record.getMessage().replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        line = f'ts={ts} level={record.levelname.lower()} logger={record.name} msg="{message}"'
        if record.exc_info:
            line += ' exc="' + self.formatException(record.exc_info).replace('"', "'").replace("\n", "\\n") + '"'
        return line


def setup(level: str) -> None:
    root = logging.getLogger()
    if not any(isinstance(h.formatter, LogfmtFormatter) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(LogfmtFormatter())
        root.addHandler(handler)
    root.setLevel(level.upper())
