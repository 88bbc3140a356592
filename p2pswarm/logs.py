"""Logging set-up: human-readable lines on stderr by default, one JSON object a line on request.

py-libp2p logs routine events (a peer hanging up mid-handshake) as warnings and errors, and
configures its own "libp2p" logger when imported (level WARNING, own handler, no propagation).
``quiet_libp2p`` imports it first and then takes that logger back: CRITICAL only unless the
user asks for debug output, and through our handler so ``--log-format json`` holds for it too.
"""

from __future__ import annotations

import json
import logging
import sys
import time

LOG_FORMATS = ("human", "json")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str = "info", fmt: str = "human") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)-5s %(name)s: %(message)s", "%H:%M:%S")
        formatter.converter = time.localtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def quiet_libp2p(level: str) -> None:
    """Import libp2p (which sets up its logger) and then route its logger through ours."""
    import libp2p  # noqa: F401 - importing runs libp2p.utils.logging.setup_logging

    libp2p_logger = logging.getLogger("libp2p")
    libp2p_logger.handlers[:] = []
    libp2p_logger.propagate = True
    libp2p_logger.setLevel(logging.WARNING if level == "debug" else logging.CRITICAL)
