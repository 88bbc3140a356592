"""Logging set-up: human-readable lines on stderr by default, one JSON object a line on request.

py-libp2p logs routine events (a peer hanging up mid-handshake) as errors; its loggers are
quieted to CRITICAL unless the user asks for debug output.
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
    logging.getLogger("libp2p").setLevel(logging.WARNING if level == "debug" else logging.CRITICAL)
