"""Alert forwarding: an Alertmanager alert that reached the wrong node's agent goes on to the right one.

Alertmanager's webhook receiver has one fixed URL (on Kubernetes, the chart's Service: any node's agent),
but a capture must run on the node where the job trains. An agent that receives an alert for another
host forwards it to that host's agent, addressed by the host part of the alert's ``forward_label``
(``instance`` is ``<node IP>:9847`` with the chart's host networking), over the control API with the
agents' shared token. Safe by construction:

- only to IP addresses inside ``alerts.forward_networks`` (never a DNS name, never anywhere else), so an
  alert's labels cannot send the token to a host the operator did not name;
- a forwarded request carries ``X-Tfprofd-Forwarded-By`` and is never forwarded again: no loops;
- the receiving agent dedupes and captures; the forwarding one remembers nothing, so Alertmanager's retry
  (a failed forward answers 503) reaches the capturing agent again, which captures at most once.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Callable
from typing import Any

from . import outbound
from .errors import ForwardFailed

log = logging.getLogger("tfprofd.alerts")

FORWARDED_HEADER = "X-Tfprofd-Forwarded-By"


class AlertForwarder:
    def __init__(self, settings: Callable[[], Any], api_port: Callable[[], int], token: Callable[[], str],
                 origin: Callable[[], str]):
        self.settings = settings
        self.api_port = api_port
        self.token = token
        self.origin = origin

    def target(self, labels: dict[str, str]) -> str | None:
        """``host:port`` of the agent an alert with these labels belongs to, if forwarding may reach it."""
        s = self.settings()
        value = labels.get(s.forward_label)
        if not s.forward_networks or not value:
            return None
        try:
            address = ipaddress.ip_address(_host(value))
        except ValueError:
            return None
        if not any(address in network for network in s.forward_networks):
            return None
        port = s.forward_port or self.api_port()
        return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"

    def forward(self, target: str, payload: dict[str, Any], alerts: list[dict[str, Any]]) -> dict[str, Any]:
        """Send ``alerts`` (in a copy of the webhook ``payload``) to the agent at ``target``; its answer.

        Raises ForwardFailed when that agent cannot be reached or asks for a retry (5xx). The token goes to that
        address alone (``outbound``: no proxy, no redirect)."""
        try:
            status, answer, _ = outbound.request(
                f"http://{target}/api/v1/alerts", method="POST",
                body=json.dumps({**payload, "alerts": alerts}).encode(),
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.token()}",
                         FORWARDED_HEADER: self.origin()},
                timeout=self.settings().forward_timeout, max_bytes=1 << 16)
        except outbound.OutboundError as exc:
            raise ForwardFailed(f"agent at {target}: {exc}") from None
        if status >= 500:
            raise ForwardFailed(f"agent at {target} answered {status}; Alertmanager will send again")
        if status != 200:
            log.warning("forwarded alerts to %s: it answered %d: %s", target, status, answer[:200])
        try:
            return {"to": target, "status": status, "answer": outbound.strict_json(answer)}
        except ValueError:  # not JSON, cut at 64 KiB, or NaN: not passed on
            return {"to": target, "status": status}


def _host(value: str) -> str:
    """The host of ``host``, ``host:port`` or ``[v6]:port``."""
    if value.startswith("["):
        return value[1:value.find("]")]
    return value.split(":")[0] if value.count(":") == 1 else value
