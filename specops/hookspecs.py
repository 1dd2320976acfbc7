"""The plugin hooks. A plugin is any module or package registered under the ``specops`` entry-point group.

The built-in vLLM and llama.cpp backends are registered through exactly these hooks, from
``[project.entry-points.specops]`` in specops' own pyproject, so a third-party backend is a peer of them.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("specops")
hookimpl = pluggy.HookimplMarker("specops")


@hookspec
def specops_backends():
    """Return a list of :class:`specops.backends.base.Backend` instances this plugin provides."""


@hookspec
def register_commands(cli):
    """Add click commands to the ``specops`` group ``cli`` (e.g. with ``@cli.command()``).

    Called when the command line lists its commands or meets a name that is not a built-in one; a
    plugin may not reuse a built-in command's name.
    """


@hookspec
def capture_redact(record):
    """Return the capture ``record`` to keep (edited as needed), or None to keep nothing of it.

    ``record`` is what ``capture:`` is about to write for ``specops adapt``: a dict with ``path``, ``class``,
    ``prompt`` (completions) or ``messages`` (chat) and ``output`` (the target's answer); never a header.
    Plugins are called in turn, each on the previous one's result; one that fails drops the record.
    """
