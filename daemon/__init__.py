"""The tfprofd agent: CLI, configuration, sampling loop, rules, captures, analysis and HTTP API."""

# The one place the version is written; pyproject.toml reads it from here (importlib.metadata would cost
# the agent ~0.8 MB of resident memory for the same string).
__version__ = "0.2.0"
