"""Run a program with a private ``/etc/hosts``: ``unshare -rm python podns.py HOSTS -- PROGRAM ARGS...``.

The pod processes of tests/support_multinode.py resolve the hostnames LeaderWorkerSet gives its pods to
their loopback addresses this way, without touching the machine's own ``/etc/hosts``: inside a private
mount namespace (``unshare -m``), HOSTS is bind-mounted over ``/etc/hosts``, then PROGRAM replaces this
process (no shell).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

MS_BIND = 4096


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: podns.py HOSTS -- PROGRAM [ARGS...]")
    hosts, program = argv[0], argv[2:]
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.mount(hosts.encode(), b"/etc/hosts", None, MS_BIND, None) != 0:
        err = ctypes.get_errno()
        sys.exit(f"podns: cannot bind {hosts} over /etc/hosts: {os.strerror(err)} (run it under unshare -rm)")
    try:
        os.execvp(program[0], program)
    except OSError as exc:
        sys.exit(f"podns: cannot run {program[0]}: {exc.strerror} (is it on the pod's PATH?)")


if __name__ == "__main__":
    main(sys.argv[1:])
