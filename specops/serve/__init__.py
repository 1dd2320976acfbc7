"""The running deployment: what ``specops up`` builds and keeps alive.

- :mod:`~specops.serve.up`: the composition root: the instance's lock and state, the supervisor, the watcher,
  the fallback decider, the proxy, the profile reloader, wired together and run until a signal;
- :mod:`~specops.serve.twins`: the engines kept warm beside the primary and routed per request;
- :mod:`~specops.serve.canary`: a new draft measured on a share of live traffic before it is promoted.
"""
