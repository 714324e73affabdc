"""Config problems: each names where the bad value came from, and all are reported at once."""

from __future__ import annotations

from dataclasses import dataclass


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
        super().__init__("\n".join(str(p) for p in self.problems))


def _source_order(problem: Problem) -> tuple[str, int, str]:
    name, _, line = problem.source.rpartition(":")
    return (name, int(line), problem.key) if line.isdigit() else (problem.source, 0, problem.key)
