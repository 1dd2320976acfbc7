"""``specops validate``: check profiles (files and directories) the way CI should."""

from __future__ import annotations

from pathlib import Path

import click

from specops.commands._common import echo_json
from specops.config.profile import LoadedProfile, load_profile
from specops.config.yamlsource import parse, read_text
from specops.errors import Location, Problem, ProfileError, SpecopsError
from specops.perf.verifycost import decision_curve
from specops.plugins import Registry, get_registry
from specops.redact import MASK
from specops.watch.rule import Rule, rule_for

PROFILE_SUFFIXES = (".yaml", ".yml")


def collect(paths: list[str]) -> tuple[list[Path], set[Path]]:
    """Profiles to validate, and which of them other profiles ``extends`` (bases).

    A directory is searched recursively for ``*.yaml``/``*.yml``. A base that is not a complete profile
    on its own (a partial overlay base) is not an error: it is checked through the profiles that extend it.
    """
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if _safe(p.is_dir):
            files += sorted(f for f in p.rglob("*") if f.suffix in PROFILE_SUFFIXES and _safe(f.is_file))
        else:
            files.append(p)
    bases: set[Path] = set()
    for f in files:
        for parent in _extends_of(f):
            resolved = _safe((f.parent / parent).resolve)
            if resolved:
                bases.add(resolved)
    return files, {f for f in files if _safe(f.resolve) in bases}


def _safe(call):
    """``call()``, or None where the path cannot be used (a symlink loop, a NUL byte, no permission)."""
    try:
        return call()
    except (OSError, ValueError, RuntimeError):
        return None


def _extends_of(path: Path) -> list[str]:
    try:
        doc = parse(read_text(path, str(path)), str(path), env=_AnyEnv())
    except (SpecopsError, OSError, UnicodeDecodeError):
        return []
    ext = doc.data.get("extends")
    return [ext] if isinstance(ext, str) else [e for e in ext if isinstance(e, str)] if isinstance(ext, list) else []


class _AnyEnv(dict):
    """An environment in which every variable is set: finding `extends` must not depend on it."""

    def __contains__(self, key):
        return True

    def __getitem__(self, key):
        return ""


@click.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json", "github"]),
    default="text",
    show_default=True,
    help="text for people; json for scripts; github for GitHub Actions annotations.",
)
@click.option(
    "--resolve",
    "do_resolve",
    is_flag=True,
    help="Also resolve drafts and run the compatibility checks (uses the Hub unless offline).",
)
@click.option("--offline", is_flag=True, help="With --resolve: use only the lock file, the HF cache and the catalog.")
@click.option(
    "--require-certificate",
    is_flag=True,
    help="Fail unless each profile has a current certificate from `specops certify` (PROFILE.cert.json): "
    "missing, not certified, or stale (profile, engine version, target/draft revision or chat template changed).",
)
def validate(paths, fmt, do_resolve, offline, require_certificate):
    """Validate profiles: schema, cross-field rules and backend support, with file:line:column errors.

    PATHS may be files or directories (searched recursively for *.yaml / *.yml; files that other
    profiles `extends` are checked through them). Exit code 1 when any profile has an error.

    A profile that pins engine.version is checked against that version's gates and against what specops'
    support matrix measured on the real engine (refused there: an error naming a version that runs it).
    `measured` / `inferred` says whether the method was seen speculating on that version (with tiny
    checkpoints) or is only inferred from the engine's source.

    \b
    Examples:
      specops validate profiles/
      specops validate --format github deploy/*.yaml      # annotations in GitHub Actions
    """
    registry = get_registry()
    profiles, bases = collect(list(paths))
    skipped: list[Path] = []
    results = []
    for path in profiles:
        result = _check_one(
            path,
            registry,
            is_base=path in bases,
            do_resolve=do_resolve,
            offline=offline,
            certificate=require_certificate,
        )
        if result is None:
            skipped.append(path)
        else:
            results.append(result)

    if not profiles:
        raise SpecopsError(f"no profiles found in {', '.join(paths)} (looked for *.yaml, *.yml)")
    if fmt == "json":
        echo_json(
            {"ok": all(r["ok"] for r in results), "profiles": results, "skipped_bases": [str(s) for s in skipped]}
        )
    elif fmt == "github":
        _print_github(results)
    else:
        _print_text(results, skipped)
    if not all(r["ok"] for r in results):
        raise SystemExit(1)


def _check_one(
    path: Path, registry: Registry, *, is_base: bool, do_resolve: bool, offline: bool, certificate: bool = False
) -> dict | None:
    """One profile's result row (its errors, warnings and summary); None for a base that is only partial."""
    problems: list[Problem] = []
    warnings: list[Problem] = []
    summary = {}
    try:
        loaded = load_profile(path, registry=registry)
        p = loaded.profile
        summary = {
            "name": _shown(loaded, ("name",), p.name),
            "backend": _shown(loaded, ("backend",), p.backend),
            "method": p.speculative.method.value,
        }
        support = registry.backend(p.backend).support(p.speculative.method, p.engine.version)
        if support:
            summary["support"], summary["support_note"] = support
            summary["engine_version"] = p.engine.version
        summary["fallback_rule"] = _fallback_rule(p).to_dict()
        if do_resolve:
            from specops.resolve.resolver import check_loaded  # the resolver pulls in the Hub client: only when asked

            for finding in check_loaded(loaded, offline=offline):
                target = problems if finding.severity == "error" else warnings
                target.append(loaded.problem(finding.path, finding.message))
        else:  # the twins' memory fit from local model files (check_loaded does it with what it resolved)
            from specops.resolve.memory import local_twin_problems

            misfits = local_twin_problems(p)
            problems += [loaded.problem(path, message) for path, message in misfits]
            if misfits:
                from specops.k8s.pools import same_pod_replacement

                summary["twin_replacement"] = same_pod_replacement(loaded)
        if certificate:
            _check_certificate(loaded, registry, problems, warnings, summary)
    except ProfileError as exc:
        if is_base and _only_incomplete(exc):
            return None
        problems = exc.problems
    except SpecopsError as exc:
        problems = [Problem(Location(str(path), 1, 1), "", str(exc))]
    return {
        "file": str(path),
        "ok": not problems,
        **summary,
        "errors": [p.to_dict() for p in problems],
        "warnings": [w.to_dict() for w in warnings],
    }


#: Why validate matches no curve for a profile that pins no engine version.
NO_VERSION = (
    "without engine.version no stored verification-cost curve can be matched (`specops doctor` matches one for the "
    "engine it finds)"
)


def _fallback_rule(profile) -> Rule:
    """Which rule would decide the profile's fallback here: a stored verification-cost curve is matched for a
    pinned ``engine.version`` only (validate starts no engine)."""
    version = profile.engine.version
    if version:
        return rule_for(profile.fallback, decision_curve(profile, version))
    return rule_for(profile.fallback, None, NO_VERSION)


def _check_certificate(
    loaded: LoadedProfile, registry: Registry, problems: list, warnings: list, summary: dict
) -> None:
    """--require-certificate: a located error when the certificate is missing, not certified or stale."""
    from specops.perf.certify_file import certificate_report

    rep = certificate_report(loaded, registry)
    name = rep["path"].name
    if not rep["exists"]:
        problems.append(
            Problem(
                Location(loaded.path, 1, 1),
                "",
                f"no certificate: {name} is missing beside the profile; run `specops certify {loaded.path}`",
            )
        )
        return
    summary["certificate"] = str(rep["path"])
    cert = rep["cert"]
    if not rep["certified"]:
        why = "; ".join((cert.get("verdict") or {}).get("findings") or []) or "its verdict is not certified"
        problems.append(Problem(Location(loaded.path, 1, 1), "", f"{name} does not certify this deployment: {why}"))
    for d in rep["stale"]:
        msg = f"{name} is stale: {d.message()}; run `specops certify {loaded.path}` again"
        where = d.profile_path
        if where and loaded.document.locate(where) is not None:
            problems.append(loaded.problem(where, msg))
        else:
            problems.append(Problem(Location(loaded.path, 1, 1), "", msg))
    for d in rep["unchecked"]:
        warnings.append(Problem(Location(loaded.path, 1, 1), "", f"{name}: {d.message()}"))


def _print_github(results: list[dict]) -> None:
    """GitHub Actions workflow commands: one annotation per error and warning, the count on stderr."""
    for r in results:
        for kind, items in (("error", r["errors"]), ("warning", r["warnings"])):
            for e in items:
                file = _gh_property(e["file"] or r["file"])
                where = f"file={file},line={e['line'] or 1},col={e['column'] or 1}"
                msg = (f"{e['field']}: " if e["field"] else "") + e["message"]
                click.echo(f"::{kind} {where},title=specops::{_gh_escape(msg)}")
    bad = sum(not r["ok"] for r in results)
    click.echo(f"specops: {len(results) - bad} valid, {bad} invalid", err=True)


def _print_text(results: list[dict], skipped: list[Path]) -> None:
    for r in results:
        if r["ok"]:
            support = f", {r['support']} on {r['engine_version']}" if r.get("support") else ""
            click.echo(f"ok      {r['file']}  ({r['backend']}, {r['method']}{support})")
            if r.get("fallback_rule"):
                click.echo(f"        {r['fallback_rule']['line']}")
        for e in r["errors"]:
            click.echo(f"error   {_line(e)}")
        for line in r.get("twin_replacement", []):
            click.echo(f"        {line}")
        for w in r["warnings"]:
            click.echo(f"warning {_line(w)}")
    for s in skipped:
        click.echo(f"base    {s}  (checked through the profiles that extend it)")
    bad = sum(not r["ok"] for r in results)
    click.echo(f"{len(results) - bad} valid, {bad} invalid", err=True)


def _shown(loaded: LoadedProfile, path: tuple, value: str) -> str:
    """``value`` as validate prints it: hidden when ``${VAR}`` took it from the environment."""
    return MASK if any(t.path == path for t in loaded.document.env_texts) else value


def _only_incomplete(exc: ProfileError) -> bool:
    """True when a base fails only for being partial (required fields missing), not for a real error."""
    return all(p.message == "required field is missing" for p in exc.problems)


def _line(e: dict) -> str:
    where = f"{e['file']}:{e['line']}:{e['column']}: " if e["file"] else ""
    return where + (f"{e['field']}: " if e["field"] else "") + e["message"]


def _gh_escape(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _gh_property(text: str) -> str:
    """A workflow-command property value (``file=...``): ``,`` and ``:`` would end it early."""
    return _gh_escape(text).replace(":", "%3A").replace(",", "%2C")
