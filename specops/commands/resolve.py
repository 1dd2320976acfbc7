"""``specops resolve`` and ``specops lock``: find, check and pin the draft for a target."""

from __future__ import annotations

import os

import click

from specops.backends import DEFAULT_BACKEND
from specops.commands._common import echo_json, json_option, load, version_param
from specops.errors import SpecopsError
from specops.methods import Method

METHOD_CHOICES = [m.value for m in Method if m not in (Method.NONE, Method.SUFFIX)]
SEVERITY_MARK = {"error": "error  ", "warning": "warning", "info": "info   "}


def _progress(msg: str) -> None:
    click.echo(f"  … {msg}", err=True)


@click.command()
@click.argument("target")
@click.option(
    "--method",
    type=click.Choice(METHOD_CHOICES),
    default=None,
    help="Method to resolve (default: auto, or the profile's when TARGET is a profile).",
)
@click.option("--backend", default=None, help="vllm (default) or llamacpp; with a profile: the profile's.")
@click.option("--max-model-len", type=int, help="Context to serve (checked against the draft's trained context).")
@click.option(
    "--tp", "tensor_parallel_size", type=int, default=1, show_default=True, help="Target tensor parallel size."
)
@click.option("--quant", help="llama.cpp: GGUF quantisation of the draft (default Q4_K_M).")
@click.option("--memory-gb", type=float, help="Memory budget per GPU (GiB) for the fit warning.")
@click.option("--backend-version", callback=version_param, help="Check method support against this engine version.")
@click.option(
    "--offline", is_flag=True, help="Use only the lock, the HF cache and the catalog (also HF_HUB_OFFLINE=1)."
)
@click.option("--all", "show_all", is_flag=True, help="Also print info findings for every candidate.")
@json_option
def resolve(
    target,
    method,
    backend,
    max_model_len,
    tensor_parallel_size,
    quant,
    memory_gb,
    backend_version,
    offline,
    show_all,
    as_json,
):
    """Rank the drafts for TARGET (a Hub id, or a profile file) and check each against it.

    Candidates come from the curated catalog, then the Hub (base_model tags, eagle / speculator /
    medusa / accelerator repos naming the target, same-family small models), ranked catalog >
    speculators verifier > base_model tag > name, then downloads. Each checked candidate gets a
    verdict (ok, warning, refused) with its reason. A catalog pair also prints its source and how it is
    known: its draft format measured speculating on an engine version (a tiny checkpoint, from the
    support matrix), or documented only. Exit code 1 when nothing passes.

    \b
    Examples:
      specops resolve meta-llama/Llama-3.1-8B-Instruct --max-model-len 8192
      specops resolve Qwen/Qwen3-8B --method draft_model --json
      specops resolve Qwen/Qwen2.5-7B-Instruct-GGUF --backend llamacpp --quant Q8_0
      specops resolve profiles/llama31-8b-eagle3.yaml --offline
    """
    from specops.resolve.resolver import resolve as run_resolve
    from specops.resolve.resolver import synthetic_profile

    progress = None if as_json else _progress
    if target.endswith((".yaml", ".yml")) and os.path.isfile(target):
        res = _resolve_profile_file(target, method, backend, offline, progress)
    else:
        profile = synthetic_profile(
            target,
            backend=backend or DEFAULT_BACKEND,
            method=method or "auto",
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            quant=quant,
            memory_gb=memory_gb,
            engine_version=backend_version,
        )
        res = run_resolve(profile, offline=offline, progress=progress)
    if as_json:
        echo_json(res.to_dict())
    else:
        click.echo(format_resolution(res, show_all=show_all), nl=False)
    if res.choice is None or res.errors:
        raise SystemExit(1)


def _resolve_profile_file(target: str, method: str | None, backend: str | None, offline: bool, progress):
    """Resolve a profile file: as written (its lock ignored), or with ``--method``/``--backend`` applied."""
    from specops.resolve.resolver import resolve as run_resolve
    from specops.resolve.resolver import resolve_profile

    loaded = load(target)
    if not (method or backend):
        return resolve_profile(loaded, offline=offline, use_lock=False, raise_errors=False, progress=progress)
    profile = loaded.profile
    spec = profile.speculative
    update = {}
    if method:
        m = Method(method)
        update["speculative"] = spec.model_copy(
            update={"method": m, "draft": "auto" if m.value not in ("auto", "mtp", "ngram") else None}
        )
    if backend:
        update["backend"] = backend
    profile = profile.model_copy(update=update)
    return run_resolve(profile, offline=offline, progress=progress)


@click.command()
@click.argument("profile", type=click.Path(dir_okay=False, path_type=str))
@click.option("--offline", is_flag=True, help="Use only the HF cache and the catalog (also HF_HUB_OFFLINE=1).")
@click.option(
    "--check",
    "check_only",
    is_flag=True,
    help="Do not resolve: exit 1 unless the lock exists and matches the profile (for CI).",
)
@json_option
def lock(profile, offline, check_only, as_json):
    """Resolve PROFILE's draft and pin it in <profile>.lock.json next to it.

    The lock pins the method, draft repo, GGUF file and the commit shas of draft and target, with every
    alternative considered and its verdict. `render` and `up` use it while it matches the profile (no Hub
    needed) and say when it is stale, so GitOps deploys are reproducible.

    \b
    Examples:
      specops lock profiles/llama31-8b-auto.yaml
      specops lock --check profiles/llama31-8b-auto.yaml      # in CI: fail when the lock is stale
    """
    from specops.resolve.lock import lock_path, read_lock, stale_reason
    from specops.resolve.resolver import lock_profile

    loaded = load(profile)
    if check_only:
        path = lock_path(profile)
        if not path.is_file():
            raise SpecopsError(f"{path.name} does not exist: run `specops lock {profile}`")
        reason = stale_reason(read_lock(path), loaded.profile)
        if reason:
            raise SpecopsError(f"{path.name} is stale: {reason}; run `specops lock {profile}`")
        click.echo(f"{path.name} is up to date")
        return
    path, res = lock_profile(loaded, offline=offline, progress=None if as_json else _progress)
    if as_json:
        echo_json({"lock_file": str(path), **res.to_dict()})
        return
    click.echo(format_resolution(res), nl=False)
    click.echo(f"wrote {path}")


# ------------------------------------------------------------------------------------------- output


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _name(c) -> str:
    name = c.draft or ("(target's MTP layers)" if c.method is Method.MTP else "-")
    return name + (f" [{c.file}]" if c.file else "")


def _candidate_table(res, show_all: bool) -> list[str]:
    """One row per candidate (the choice starred), with its findings, note and caveats beneath; a catalog pair
    also with its source and how it is known (its format measured on an engine, or documented only)."""
    from specops.resolve.catalog import format_evidence

    lines = [""]
    width = max(len(_name(c)) for c in res.candidates)
    width = min(max(width, 10), 72)
    lines.append(f"  #  {'verdict':<9}{'method':<15}{'draft':<{width}}  ranked by")
    for i, c in enumerate(res.candidates, 1):
        name = _name(c)
        mark = "*" if c is res.choice else " "
        lines.append(f"{mark}{i:>2}  {c.verdict:<9}{c.method.value:<15}{_cut(name, width):<{width}}  {c.why()}")
        shown = [x for x in c.findings if x.severity != "info" or show_all]
        for x in shown:
            lines.append(f"       {SEVERITY_MARK[x.severity]}  {x.check}: {x.message}")
        if c.verdict == "unchecked" and c.note:
            lines.append(f"       {c.note}")
        if c.entry is not None:
            lines.append(f"       source   {c.entry.source}")
            lines.append(f"       known    {format_evidence(c.entry, engine=res.profile.backend)}")
        if c is res.choice or show_all:
            for cav in c.caveats:
                lines.append(f"       caveat   {cav}")
    return lines


def format_resolution(res, *, show_all: bool = False) -> str:
    lines: list[str] = []
    t = res.target
    p = res.profile
    if t is not None:
        f = t.facts
        facts = ", ".join(
            x
            for x in (
                f"vocab {f.vocab}" if f.vocab else "",
                f"hidden {f.hidden}" if f.hidden else "",
                f"{f.layers} layers" if f.layers else "",
                f"context {f.context}" if f.context else "",
                f"{f.mtp_layers} MTP layer(s)" if f.mtp_layers else "",
            )
            if x
        )
        rev = f" @ {t.revision[:10]}" if t.revision else ""
        lines.append(f"target   {t.ref}{rev}" + (f"  ({facts}; from {t.facts_source})" if facts else ""))
    served = p.model.max_model_len
    lines.append(
        f"backend  {p.backend}   requested: {res.requested}" + (f"   served context {served}" if served else "")
    )
    if res.candidates:
        lines += _candidate_table(res, show_all)
    lines.append("")
    if res.choice is not None:
        c = res.choice
        spec = p.speculative
        what = f"{spec.method}" + (f" {spec.draft}" if spec.draft else "")
        if spec.draft_revision:
            what += f"@{spec.draft_revision[:10]}"
        if spec.draft_file:
            what += f" ({spec.draft_file})"
        lines.append(f"choice   {what} — {c.why(popularity=False)}; {c.reason}")
    else:
        lines.append("choice   none: no candidate passes the checks")
    for f in res.findings:
        if f.severity == "error" and (res.choice is None or f not in res.choice.findings):
            lines.append(f"error    {f.message}")
    if res.memory is not None:
        lines.append(f"memory   {res.memory.line()}")
    for n in res.notes:
        lines.append(f"note     {n}")
    return "\n".join(lines) + "\n"
