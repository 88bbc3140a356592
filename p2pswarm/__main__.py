"""``python -m p2pswarm`` and the ``p2pswarm`` command: the command line.

A node command first re-executes itself with glibc's malloc (``allocator``), before the package's
imports, so that its start pays for them once, and leaves without the interpreter's finalization
once it has shut down cleanly.
"""

from __future__ import annotations

import sys

from p2pswarm.allocator import NODE_COMMANDS, command_of, exit_at_once, imports_without_collections, use_system_malloc


def run() -> int:
    use_system_malloc(sys.argv[1:])  # returns at once but for a node command that needs the re-exec
    with imports_without_collections(keep=False):  # a node's own imports are kept by cli.main
        from p2pswarm.cli import main  # lazy: after the re-exec, so that libp2p and torch are imported once

    code = main()
    if command_of(sys.argv[1:]) in NODE_COMMANDS:
        exit_at_once(code)  # shut down cleanly already: skip the seconds of freeing every object one by one
    return code


if __name__ == "__main__":
    raise SystemExit(run())
