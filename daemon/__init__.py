"""The tfprofd agent: CLI, configuration, sampling loop, rules, captures, analysis and HTTP API."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tfprofd")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"
