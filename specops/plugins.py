"""Finding backends: load every plugin of the ``specops`` entry-point group and collect what it offers."""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field

import pluggy

from specops import hookspecs
from specops.errors import SpecopsError

#: Modules of the built-in plugins; registered from entry points like any other plugin, and directly only
#: when specops runs from a source tree without its distribution metadata.
BUILTIN_PLUGINS = ("specops.backends.vllm", "specops.backends.llamacpp")


@dataclass
class Registry:
    """Everything the installed plugins provide, with where each piece came from."""

    backends: dict = field(default_factory=dict)
    origins: dict = field(default_factory=dict)  # backend name -> "plugin-name (dist version)"

    def backend(self, name: str):
        try:
            return self.backends[name]
        except KeyError:
            raise SpecopsError(f"unknown backend {name!r} (installed: {', '.join(sorted(self.backends))})") from None


def plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("specops")
    pm.add_hookspecs(hookspecs)
    pm.load_setuptools_entrypoints("specops")
    for module_name in BUILTIN_PLUGINS:
        if not any(getattr(p, "__name__", None) == module_name for p in pm.get_plugins()):
            pm.register(importlib.import_module(module_name), name=module_name.rsplit(".", 1)[-1])
    return pm


@functools.lru_cache(maxsize=1)
def get_registry() -> Registry:
    pm = plugin_manager()
    dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    registry = Registry()
    for plugin in pm.get_plugins():
        impl = getattr(plugin, "specops_backends", None)
        if impl is None:
            continue
        dist = dists.get(id(plugin))
        origin = pm.get_name(plugin) or getattr(plugin, "__name__", "?")
        origin += f" ({dist.project_name} {dist.version})" if dist is not None else " (source tree)"
        for backend in impl() or []:
            if backend.name in registry.backends:
                raise SpecopsError(f"backend {backend.name!r} is registered twice: by "
                                   f"{registry.origins[backend.name]} and by {origin}")
            registry.backends[backend.name] = backend
            registry.origins[backend.name] = origin
    return registry
