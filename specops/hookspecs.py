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
