"""The ``tfprofd`` command's entry point: says plainly when this is a hook-only install."""

from __future__ import annotations

import sys

AGENT_MODULES = {"prometheus_client", "psutil", "yaml", "pynvml", "grpc", "google", "xprof"}


def main() -> int:
    from .cli import main as cli_main  # the standard library only: the agent's modules load per command

    try:
        return cli_main()
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in AGENT_MODULES:
            raise
        print(f"tfprofd: this install has the training hook only (no {exc.name}); the agent needs its "
              "dependencies: pip install 'tfprofd[agent]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
