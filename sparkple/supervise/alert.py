"""Optional alert webhook: rate-limited per event kind, and never blocking the caller.

The URL comes from the environment (PLE_ALERT_URL, set through a 0600 env file) because it often
embeds a token. The POST body is JSON with a `text` field, which Slack- and Mattermost-style
incoming webhooks display as is, plus structured fields for anything else. Sending happens on a
background thread with a short timeout; a dead or hung receiver costs the caller nothing, and a
failed send is logged, not retried (the next incident sends again).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from .state import iso, locked, read_json_object, write_json

ENV_URL = "PLE_ALERT_URL"


class Alerter:
    def __init__(
        self,
        state_dir: Path,
        url: str | None = None,
        min_interval_s: float = 900.0,
        timeout_s: float = 3.0,
    ) -> None:
        self.url = url if url is not None else os.environ.get(ENV_URL, "")
        self.min_interval_s = min_interval_s
        self.timeout_s = timeout_s
        self.state_path = state_dir / "alerts.json"
        self.lock_path = state_dir / "alerts.lock"
        self._threads: list[threading.Thread] = []

    def send(self, event: str, message: str, details: dict[str, Any] | None = None) -> bool:
        """Queue an alert; returns whether it was queued (False: no URL, or rate-limited)."""
        if not self.url:
            return False
        now = time.time()
        # The rate limit lives in the state dir because the probe is a new process every run.
        with locked(self.lock_path):
            sent = read_json_object(self.state_path)
            last = sent.get(event)
            if isinstance(last, int | float) and now - last < self.min_interval_s:
                return False
            sent[event] = now
            write_json(self.state_path, sent)
        host = socket.gethostname()
        body = {
            "text": f"[sparkple {host}] {message}",
            "source": "sparkple",
            "host": host,
            "event": event,
            "message": message,
            "time": iso(now),
            "details": details or {},
        }
        thread = threading.Thread(target=self._post, args=(body,), daemon=True)
        thread.start()
        self._threads.append(thread)
        return True

    def _post(self, body: dict[str, Any]) -> None:
        request = urllib.request.Request(
            self.url,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read(1024)
        except Exception as exc:  # any failure is only logged
            print(f"alert {body['event']!r} not delivered: {exc}", file=sys.stderr, flush=True)

    def drain(self, timeout_s: float | None = None) -> None:
        """Give queued alerts up to `timeout_s` (default: the send timeout) before exit."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]
