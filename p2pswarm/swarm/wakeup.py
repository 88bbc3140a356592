"""A condition variable for one trio loop: waiters sleep until the next ``notify``.

``trio.Event`` cannot be cleared, so code that waits "until the next time something changes"
ends up re-arming events by hand. ``Wakeup`` does it in one place: ``wait`` returns at the next
``notify`` after it was called (any number of waiters); ``version`` counts the notifies.
Trio runs one task at a time: a waiter that checks its condition and then waits, with no
checkpoint in between, never misses a notify.
"""

from __future__ import annotations

import trio


class Wakeup:
    """Wakes every waiter at each ``notify`` (module docstring)."""

    def __init__(self) -> None:
        self.version = 0  # notifies so far
        self._event = trio.Event()

    def notify(self) -> None:
        self.version += 1
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        """Until the next ``notify``."""
        await self._event.wait()
