"""README's commands, run as a newcomer would paste them (against a real agent on loopback)."""

from __future__ import annotations

import json
import re
import subprocess

from helpers import ROOT, AgentProcess


def _sh_block(section: str) -> str:
    """The first ```sh block under the README heading ``section``."""
    text = (ROOT / "README.md").read_text()
    body = text[text.index(f"\n{section}\n"):]
    return re.search(r"```sh\n(.*?)```", body, re.S)[1]


def test_control_api_curl_example_is_authorized(tmp_path):
    agent = AgentProcess(tmp_path).start()
    try:
        block = _sh_block("### Control API")
        lines = [ln for ln in block.splitlines()
                 if ln.startswith("TOKEN=") or (ln.startswith("curl ") and "-XPOST" in ln)]
        script = "\n".join(lines).replace("/var/lib/tfprofd", str(tmp_path / "state")).replace(
            "localhost:9848", f"127.0.0.1:{agent.api_port}")
        result = subprocess.run(["bash", "-euc", script], capture_output=True, text=True, timeout=30)
        answer = json.loads(result.stdout)
        # No job reports to this agent: past the token check, the API says which job it could not find.
        assert "bearer token" not in answer.get("error", ""), answer
        assert "resnet50" in answer["error"], answer
    finally:
        agent.stop()
