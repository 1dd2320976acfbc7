"""Finding plugins: load every module of the ``specops`` entry-point group and call its hooks through pluggy.

Hooks are called through the plugin manager's hook callers, so each implementation is checked against its
spec in :mod:`specops.hookspecs` (``@hookimpl`` marker, argument names) and a misspelt hook is an error
that names the plugin. Each plugin's implementation is called on its own (a one-plugin subset of the hook),
so every backend and command is known to come from its plugin and distribution (``specops plugins``), and a
plugin that fails is named in a one-line error instead of a traceback.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from dataclasses import dataclass, field

import pluggy

from specops import hookspecs
from specops.errors import SpecopsError

GROUP = "specops"
#: Modules of the built-in plugins; registered from entry points like any other plugin, and directly only
#: when specops runs from a source tree without its distribution metadata.
BUILTIN_PLUGINS = ("specops.backends.vllm", "specops.backends.llamacpp")
#: The hooks a plugin may implement (the functions of specops.hookspecs).
HOOKS = tuple(name for name, obj in vars(hookspecs).items() if callable(obj) and hasattr(obj, "specops_spec"))


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


@dataclass
class Plugins:
    """The plugin manager with every plugin registered, and where each plugin came from."""

    pm: pluggy.PluginManager
    origins: dict = field(default_factory=dict)  # plugin name -> "plugin-name (dist version)"

    def origin(self, plugin) -> str:
        name = self.pm.get_name(plugin) or getattr(plugin, "__name__", "?")
        return self.origins.get(name, f"{name} (source tree)")

    def implementers(self, hook: str) -> list:
        """The plugins that implement ``hook``, in registration order."""
        out = []
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            if impl.plugin not in out:
                out.append(impl.plugin)
        return out

    def call_one(self, hook: str, plugin, **kwargs) -> list:
        """``hook``'s results from ``plugin`` alone, through pluggy's hook caller for that one plugin.

        An exception in the plugin becomes a :class:`SpecopsError` that names it.
        """
        others = [p for p in self.implementers(hook) if p is not plugin]
        caller = self.pm.subset_hook_caller(hook, others) if others else getattr(self.pm.hook, hook)
        try:
            return caller(**kwargs)
        except SpecopsError as exc:
            raise SpecopsError(f"plugin {self.origin(plugin)}: {hook}: {exc}") from None
        except Exception as exc:  # a plugin's bug must not become a traceback of specops
            raise SpecopsError(
                f"plugin {self.origin(plugin)}: {hook} failed: {type(exc).__name__}: {_one_line(exc)}"
            ) from None

    def call(self, hook: str, **kwargs):
        """``(plugin, result)`` for each plugin that implements ``hook``, one plugin at a time."""
        for plugin in self.implementers(hook):
            for result in self.call_one(hook, plugin, **kwargs):
                yield plugin, result


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or "(no message)"


def _register(pm: pluggy.PluginManager, plugin, name: str, where: str) -> None:
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        raise SpecopsError(f"plugin {where}: {_one_line(exc)}") from None
    except ValueError as exc:  # the same module under two entry-point names
        raise SpecopsError(f"plugin {where}: {_one_line(exc)}") from None


def plugin_manager() -> pluggy.PluginManager:
    """A plugin manager with every installed plugin registered and checked (not cached)."""
    return _load().pm


def _load() -> Plugins:
    pm = pluggy.PluginManager(GROUP)
    pm.add_hookspecs(hookspecs)
    plugins = Plugins(pm)
    for dist in list(importlib.metadata.distributions()):
        label = None  # "name version", read once per distribution: each read parses its METADATA (the README)
        for ep in dist.entry_points:
            if ep.group != GROUP or pm.has_plugin(ep.name) or pm.is_blocked(ep.name):
                continue
            if label is None:
                meta = dist.metadata
                label = f"{meta['Name']} {meta['Version']}"
            where = f"{ep.name} ({label})"
            try:
                module = ep.load()
            except Exception as exc:
                raise SpecopsError(f"plugin {where} cannot be loaded: {type(exc).__name__}: {_one_line(exc)}") from None
            _register(pm, module, ep.name, where)
            plugins.origins[ep.name] = where
    for module_name in BUILTIN_PLUGINS:
        if not any(getattr(p, "__name__", None) == module_name for p in pm.get_plugins()):
            name = module_name.rsplit(".", 1)[-1]
            _register(pm, importlib.import_module(module_name), name, f"{name} (source tree)")
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        hooks = ", ".join(HOOKS)
        raise SpecopsError(
            f"plugin {plugins.origin(exc.plugin)}: {_one_line(exc).split(' in plugin ')[0]} (specops hooks: {hooks})"
        ) from None
    for plugin in pm.get_plugins():
        for hook in HOOKS:
            if callable(getattr(plugin, hook, None)) and not any(
                impl.plugin is plugin for impl in getattr(pm.hook, hook).get_hookimpls()
            ):
                raise SpecopsError(
                    f"plugin {plugins.origin(plugin)}: {hook} lacks the @hookimpl marker "
                    f"(from specops.hookspecs import hookimpl), so specops would never call it"
                )
    return plugins


@functools.lru_cache(maxsize=1)
def loaded_plugins() -> Plugins:
    """Every installed plugin, loaded and checked once per process."""
    return _load()


@functools.lru_cache(maxsize=1)
def get_registry() -> Registry:
    plugins = loaded_plugins()
    registry = Registry()
    for plugin, backends in plugins.call("specops_backends"):
        origin = plugins.origin(plugin)
        for backend in backends or []:
            if backend.name in registry.backends:
                raise SpecopsError(
                    f"backend {backend.name!r} is registered twice: by {registry.origins[backend.name]} and by {origin}"
                )
            registry.backends[backend.name] = backend
            registry.origins[backend.name] = origin
    return registry


def register_commands(group, reserved) -> dict[str, str]:
    """Let every plugin add click commands to ``group``; returns command name -> origin.

    ``reserved`` are the built-in command names: a plugin may not take one, nor a name another plugin took.
    """
    plugins = loaded_plugins()
    added: dict[str, str] = {}
    for plugin in plugins.implementers("register_commands"):
        origin = plugins.origin(plugin)
        before = dict(group.commands)
        group.commands.clear()
        try:
            plugins.call_one("register_commands", plugin, cli=group)
            new = dict(group.commands)
        finally:
            group.commands.clear()
            group.commands.update(before)
        for name, command in new.items():
            if name in reserved:
                raise SpecopsError(f"plugin {origin}: command {name!r} is one of specops' own")
            if name in added:
                raise SpecopsError(f"command {name!r} is registered twice: by {added[name]} and by {origin}")
            group.commands[name] = command
            added[name] = origin
    return added
