"""``specops doctor``: the Hub or offline mode, the HF cache, the token (never printed), Prometheus."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path

from specops.doctor.base import ERROR, OK, WARNING, Check, Context, one_line

#: A small public repo that always exists: asked for when the profile names no Hub model.
PROBE_REPO = "openai-community/gpt2"

# ---------------------------------------------------------------------------------------------- Hub


def check_hub(ctx: Context) -> list[Check]:
    from specops.resolve.hub import Hub, env_offline, hub_endpoint
    from specops.resolve.huberrors import HubError

    endpoint = hub_endpoint()
    if ctx.offline or env_offline():
        why = "--offline" if ctx.offline else "HF_HUB_OFFLINE=1"
        return [
            Check(
                "hub",
                OK,
                f"offline ({why}): drafts come from lock files, the HF cache and the catalog; engines must find "
                "their models in the HF cache or on disk",
            )
        ]
    hub = Hub(timeout=min(5.0, _hub_timeout()))
    repo, mine = PROBE_REPO, False
    if ctx.loaded is not None:
        from specops.reponames import is_repo_id

        model = ctx.loaded.profile.model.id
        if is_repo_id(model) and not os.path.exists(os.path.expanduser(model)):
            repo, mine = model, True  # the question that matters: can this machine get the target?
    gated = ""
    try:
        meta = hub.model_info(repo)
        if mine and meta.gated:
            gated = "; gated, and this machine's token has access"
            if "config.json" in meta.files:  # metadata is public; files of a gated repo need a granted token
                hub.download(repo, "config.json", ctx.loaded.profile.model.revision)
    except HubError as exc:
        if exc.kind in ("gated", "unauthorized", "not_found") and mine:
            return [
                Check(
                    "hub",
                    ERROR,
                    f"{endpoint} reachable, but model.id {repo}: {one_line(str(exc))}",
                    "accept the model's license on the Hub and set HF_TOKEN"
                    if exc.kind != "not_found"
                    else "check model.id (and HF_TOKEN for a private repo)",
                )
            ]
        if exc.kind == "unauthorized":
            return [Check("hub", ERROR, one_line(str(exc)), "renew the token (HF_TOKEN or `hf auth login`)")]
        return [
            Check(
                "hub",
                WARNING,
                f"{endpoint} not usable: {one_line(str(exc))}",
                "resolution falls back to lock files, the HF cache and the catalog; on a machine without "
                "internet set HF_HUB_OFFLINE=1 (and run `specops lock` where the Hub is reachable)",
            )
        ]
    ctx.hub_ok = True
    return [Check("hub", OK, f"{endpoint} reachable" + (f"; model.id {repo} is accessible{gated}" if mine else ""))]


def _hub_timeout() -> float:
    from specops.resolve.hub import default_timeout

    return default_timeout()


def check_hf_cache(ctx: Context) -> list[Check]:
    from specops.resolve.hub import Hub, hf_cache_dir

    cache = hf_cache_dir()
    if not cache.is_dir():
        out = [Check("hf-cache", OK, f"{cache} does not exist yet (nothing downloaded)")]
    else:
        repos = sorted(d.name for d in cache.glob("models--*") if d.is_dir())
        writable = os.access(cache, os.W_OK | os.X_OK)
        summary = f"{cache}: {len(repos)} model repo(s) cached" + ("" if writable else ", not writable")
        out = [
            Check(
                "hf-cache",
                OK if writable else WARNING,
                summary,
                "" if writable else "let this user write it, or set HF_HOME / HF_HUB_CACHE",
            )
        ]
    if ctx.loaded is not None:
        p = ctx.loaded.profile
        from specops.reponames import is_repo_id

        hub = Hub(cache_dir=cache, offline=True)
        from specops.resolve.hub import env_offline

        # the engine downloads what is missing, unless it is offline too or the Hub cannot be reached
        blocked = "HF_HUB_OFFLINE=1" if env_offline() else "" if ctx.offline or ctx.hub_ok else "the Hub is unreachable"
        for what, repo, rev in (
            ("model.id", p.model.id, p.model.revision),
            ("speculative.draft", p.speculative.draft, p.speculative.draft_revision),
        ):
            if not repo or repo == "auto" or not is_repo_id(repo) or os.path.exists(os.path.expanduser(repo)):
                continue
            sha = hub.cached_sha(repo, rev)
            if sha:
                out.append(Check("hf-cache", OK, f"{what} {repo} is in the cache (commit {sha[:10]})"))
            else:
                out.append(
                    Check(
                        "hf-cache",
                        WARNING if blocked else OK,
                        f"{what} {repo} is not in the cache"
                        + (
                            f"; {blocked}: the engine cannot download it"
                            if blocked
                            else "; the engine downloads it at start"
                        ),
                        f"download it where the Hub is reachable (`hf download {repo}`)" if blocked else "",
                    )
                )
    return out


def check_hf_token(ctx: Context) -> list[Check]:
    """Whether a token is set, and where from: never its value."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if os.environ.get(var, "").strip():
            return [Check("hf-token", OK, f"HF token: present (from {var})")]
    path = Path(
        os.environ.get("HF_TOKEN_PATH")
        or Path(
            os.environ.get("HF_HOME")
            or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
        )
        / "token"
    ).expanduser()
    try:
        if path.is_file() and path.stat().st_size > 0:
            return [Check("hf-token", OK, f"HF token: present (from the stored login {path})")]
    except OSError:
        pass
    return [
        Check(
            "hf-token",
            OK,
            "HF token: absent (needed only for gated models such as meta-llama/*: set HF_TOKEN, "
            "in the environment or the service's EnvironmentFile)",
        )
    ]


# ------------------------------------------------------------------------------------------ Prometheus


def check_prometheus(ctx: Context) -> list[Check]:
    if ctx.loaded is None or ctx.loaded.profile.monitor.source != "promql":
        return []
    from specops.urls import redact_url, split_userinfo

    mon = ctx.loaded.profile.monitor
    url = mon.prometheus_url
    if not url:
        return [Check("prometheus", ERROR, "monitor.source is promql but monitor.prometheus_url is unset", "set it")]
    shown = redact_url(url)
    bare, auth = split_userinfo(url.rstrip("/"))
    headers = {}
    if auth is not None:
        import base64

        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    req = urllib.request.Request(bare + "/-/ready", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=max(1.0, mon.timeout)) as resp:
            status = resp.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return [
            Check(
                "prometheus",
                ERROR,
                f"cannot reach Prometheus at {shown}: {one_line(str(reason), 200)}",
                "start Prometheus or fix monitor.prometheus_url; `monitor.source: scrape` reads the engine directly",
            )
        ]
    if status != 200:
        return [
            Check(
                "prometheus",
                ERROR,
                f"Prometheus at {shown} answered /-/ready with HTTP {status}",
                "check the URL (and its credentials); Prometheus answers 200 when ready",
            )
        ]
    return [Check("prometheus", OK, f"Prometheus at {shown} is ready")]
