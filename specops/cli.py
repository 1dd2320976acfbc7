"""The ``specops`` command line: a thin click layer over the library.

Commands live in ``specops/commands/<name>.py`` and are imported only when invoked, so ``specops
validate`` and ``specops render`` stay fast on a CI runner (no HTTP client, no Prometheus client, no
engine is imported for them). Plugins add commands through the ``register_commands`` hook. Every foreseeable failure is a :class:`SpecopsError`: printed as clear
lines on stderr with exit code 1 (2 for usage errors), never as a traceback.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import sys
from contextlib import contextmanager

import click

from specops import __version__
from specops.errors import ProfileError, SpecopsError

#: command name -> "module:function" (the module under specops.commands); ordered as shown in --help.
COMMANDS = {
    "init": "init:init",
    "validate": "validate:validate",
    "render": "render:render",
    "resolve": "resolve:resolve",
    "lock": "resolve:lock",
    "up": "up:up",
    "systemd": "systemd:systemd",
    "status": "status:status",
    "down": "status:down",
    "watch": "watch:watch",
    "advise": "advise:advise",
    "bench": "bench:bench",
    "tune": "tune:tune",
    "adapt": "adapt:adapt",
    "certify": "certify:certify",
    "engines": "engines:engines",
    "schema": "schema:schema",
    "plugins": "plugins:plugins",
    "doctor": "doctor:doctor",
    "k8s": "k8s:k8s",
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use.

    Commands that plugins add (the ``register_commands`` hook) are collected only when the commands are
    listed (``--help``) or a name is not a built-in one, so a built-in command never waits for them.
    """

    _plugin_commands: dict | None = None  # command name -> origin, once the plugins were asked

    def list_commands(self, ctx):
        return [name for name in COMMANDS if self._spec(name)] + sorted(self.plugin_commands())

    def get_command(self, ctx, name):
        spec = self._spec(name)
        if spec is None:
            return self.commands.get(name) if name in self.plugin_commands() else None
        module, _, attr = spec.partition(":")
        with _imports_without_gc():
            return getattr(importlib.import_module(f"specops.commands.{module}"), attr)

    def plugin_commands(self) -> dict:
        """Plugin command name -> the plugin (and distribution) that added it."""
        if self._plugin_commands is None:
            from specops.plugins import register_commands

            self._plugin_commands = register_commands(self, frozenset(COMMANDS))
        return self._plugin_commands

    @staticmethod
    def _spec(name):
        spec = COMMANDS.get(name)
        if spec is None:
            return None
        module = spec.partition(":")[0]
        return spec if importlib.util.find_spec(f"specops.commands.{module}") is not None else None


@contextmanager
def _imports_without_gc():
    """Import a command with the cyclic GC paused, then freeze what the import made.

    Importing a command builds the profile's pydantic models: tens of thousands of objects that live as long as
    the process, which the collector would scan dozens of times for nothing (about 4% of a cold ``render``).
    Frozen, later collections skip them too. Nothing is lost: import-time objects are module state.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            gc.enable()


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "--version", prog_name="specops")
def cli():
    """Run speculative decoding safely in production on vLLM and llama.cpp.

    \b
    A profile (YAML, kept in git) names the target model, the draft method and the GPU layout.
    specops validates it, renders the exact engine command for the installed engine version,
    launches and supervises the engine, watches the draft acceptance rate and falls back
    (EAGLE -> n-gram -> no speculation) when it drops, without losing client requests.

    \b
    Examples:
      specops init meta-llama/Llama-3.1-8B-Instruct  # a profile for your model on this machine
      specops validate profiles/                 # check every profile (CI)
      specops render profiles/llama31-8b-eagle3.yaml --backend-version 0.32.0
      specops up examples/vllm-cpu-ngram.yaml    # launch, supervise, fall back
    """


def main(argv=None) -> None:
    """Console entry point: runs the CLI and turns SpecopsError into clean output and exit codes."""
    try:
        cli.main(args=argv, prog_name="specops", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except ProfileError as exc:
        for problem in exc.problems:
            click.echo(f"error: {problem}", err=True)
        sys.exit(exc.exit_code)
    except SpecopsError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    sys.exit(0)


if __name__ == "__main__":
    main()
