"""How busy the machine was with other work while something was measured: CPU time on our cores that our
own process tree (the bench and the engines it started) did not take.

A benchmark on a shared machine can measure its neighbours instead of the engine: one run on 2 cores
shared with a build printed a stalled baseline as a 17.78x speedup. Linux counts both sides in jiffies —
``/proc/stat`` per core (user, nice, system, irq, softirq, steal: everything but idle and iowait) and
``/proc/<pid>/stat`` per process (utime, stime, and cutime, cstime of children it reaped) — so the
difference over an interval, divided by its length, is how many cores other processes took meanwhile.
Steal counts as other load: a hypervisor's other guests take the cores as surely as a local process does.
Only the cores this process may run on are counted (``sched_getaffinity``), so a large host's other
tenants on other cores do not count. Every counter read is rounded down to a jiffy, so the answer leaves
out what rounding could explain (one jiffy per core and per process of our tree): it is the load other
processes certainly added, which keeps a short run (a tenth of a second is 10 jiffies) from looking busy.
Where ``/proc`` cannot be read (not Linux) the answer is None.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

#: Fields of a ``cpuN`` line of /proc/stat that are busy time (after the name): user, nice, system, irq,
#: softirq, steal. Guest time is already inside user.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


@dataclass(frozen=True)
class CpuSample:
    """Busy jiffies of our cores and of our process tree at one instant."""

    at: float  # time.monotonic()
    busy: int  # all processes, on the cores we may run on
    ours: int  # this process and its descendants (the engines it started)
    counters: int = 0  # how many jiffy counters were added up (cores + our processes): the rounding


def sample(root: int | None = None) -> CpuSample | None:
    """Busy jiffies now (``root``: the process whose tree is ours, default this one); None without /proc."""
    try:
        busy, cores = _cores_busy(_our_cores())
        ours, procs = _tree_jiffies(root or os.getpid())
    except (OSError, ValueError, IndexError):
        return None
    return CpuSample(time.monotonic(), busy, ours, cores + procs)


def other_cores(before: CpuSample | None, after: CpuSample | None) -> float | None:
    """Cores that processes outside our tree certainly kept busy, on average, between two samples: their
    jiffies less the rounding of the counters read (never below 0)."""
    if before is None or after is None or after.at <= before.at:
        return None
    other = (after.busy - before.busy) - (after.ours - before.ours) - max(before.counters, after.counters)
    return max(0.0, other / _ticks_per_s() / (after.at - before.at))


def _ticks_per_s() -> int:
    return os.sysconf("SC_CLK_TCK")


def _our_cores() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: every core
        return None


def _cores_busy(cores: set[int] | None) -> tuple[int, int]:
    """Busy jiffies summed over ``cores`` (None: all) from /proc/stat's per-core lines, and how many cores."""
    total = counted = 0
    with open("/proc/stat", encoding="ascii") as f:
        for line in f:
            name, _, rest = line.partition(" ")
            if not name.startswith("cpu") or name == "cpu":
                continue
            if cores is not None and int(name[3:]) not in cores:
                continue
            fields = rest.split()
            total += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
            counted += 1
    return total, counted


def _tree_jiffies(root: int) -> tuple[int, int]:
    """utime + stime + cutime + cstime of ``root`` and every process descending from it, and how many."""
    parent: dict[int, int] = {}
    spent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": the name may hold spaces
        pid = int(entry)
        parent[pid] = int(fields[1])
        spent[pid] = sum(int(x) for x in fields[11:15])
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    total, procs, todo = 0, 0, [root]
    while todo:
        pid = todo.pop()
        total += spent.get(pid, 0)
        procs += pid in spent
        todo += children.get(pid, [])
    return total, procs
