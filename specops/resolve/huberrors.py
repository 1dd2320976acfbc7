"""How a Hub failure becomes one clear line: :class:`HubError` and :func:`translate`, which maps each of
huggingface_hub's (and the network's) failures to a ``kind`` the resolver acts on."""

from __future__ import annotations

import re

from specops.errors import SpecopsError

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class HubError(SpecopsError):
    """A Hub failure, as one line. ``kind``: not_found, gated, unauthorized, rate_limited, unreachable,
    offline, revision, entry, invalid (the answer or a file is unusable: unsafe names, a malformed or
    oversized config.json), error."""

    def __init__(self, kind: str, line: str, repo: str | None = None):
        self.kind = kind
        self.repo = repo
        # one printable line: text the Hub sent (an error message, a name) never carries control characters
        super().__init__(_CONTROL.sub(lambda m: repr(m.group(0))[1:-1], str(line))[:1000])

    @property
    def hub_is_down(self) -> bool:
        return self.kind in ("unreachable", "rate_limited", "offline")


class HubDeadline(Exception):
    """A Hub call that did not return within its deadline (raised by :meth:`Hub._call`)."""


def too_large(repo: str, filename: str, size: int | None, cap: int) -> HubError:
    what = f"is {size} bytes" if size is not None else "is larger than announced"
    return HubError(
        "invalid",
        f"{repo}/{filename} {what}; specops reads at most {cap} bytes of it ({cap // 1024} KiB): not a real {filename}",
        repo,
    )


def translate(exc: BaseException, what: str, repo: str | None, endpoint: str, deadline: float) -> HubError:
    """One clear line for each way the Hub can fail."""
    from huggingface_hub import errors as E

    name = repo or endpoint
    if isinstance(exc, HubDeadline):
        return HubError(
            "unreachable",
            f"Hub at {endpoint} did not answer in time ({what}; no answer within "
            f"{deadline:.0f} s, SPECOPS_HUB_TIMEOUT sets the limit)",
            repo,
        )
    if isinstance(exc, E.OfflineModeIsEnabled):
        return HubError("offline", f"{what}: huggingface_hub is in offline mode (HF_HUB_OFFLINE=1)", repo)
    if isinstance(exc, E.GatedRepoError):
        return HubError(
            "gated",
            f"{name} is gated: accept its license on {endpoint}/{name} and set HF_TOKEN "
            f"(a token of an account that was granted access)",
            repo,
        )
    if isinstance(exc, E.RevisionNotFoundError):
        return HubError("revision", f"{name}: revision not found on the Hub", repo)
    if isinstance(exc, E.RepositoryNotFoundError):
        return HubError("not_found", f"{name} not found on the Hub (check the id; private repos need HF_TOKEN)", repo)
    if isinstance(exc, E.EntryNotFoundError):
        return HubError("entry", f"{name}: file not found ({what})", repo)
    if isinstance(exc, E.HfHubHTTPError):
        return _http_error(exc, what, repo, endpoint)
    if isinstance(exc, E.LocalEntryNotFoundError):
        if exc.__cause__ is not None and exc.__cause__ is not exc:
            return translate(exc.__cause__, what, repo, endpoint, deadline)
        return HubError("offline", f"{name}: not in the local HF cache and the Hub is not reachable", repo)
    return _network_error(exc, what, repo, endpoint)


def _http_error(exc: BaseException, what: str, repo: str | None, endpoint: str) -> HubError:
    """An HTTP status the Hub answered with: rate limit, authorization, server failure, anything else."""
    name = repo or endpoint
    resp = getattr(exc, "response", None)
    status = getattr(resp, "status_code", None)
    if status == 429:
        wait = resp.headers.get("Retry-After") if resp is not None else None
        return HubError(
            "rate_limited",
            f"rate-limited by the Hub at {endpoint}"
            + (f" (retry in {wait} s)" if wait else "")
            + "; set HF_TOKEN for a higher limit",
            repo,
        )
    if status in (401, 403):
        return HubError("unauthorized", f"{name}: not authorized ({status}); check HF_TOKEN", repo)
    if status is not None and status >= 500:
        return HubError("unreachable", f"Hub at {endpoint} failed with HTTP {status} ({what})", repo)
    return HubError("error", f"{name}: Hub answered HTTP {status} ({what})", repo)


def _network_error(exc: BaseException, what: str, repo: str | None, endpoint: str) -> HubError:
    """A timeout, a connection that failed, or anything else that is not an answer from the Hub."""
    name = repo or endpoint
    try:
        import httpx2 as httpx

        transport, timeouts = (httpx.TransportError,), (httpx.TimeoutException,)
    except ImportError:  # pragma: no cover - older huggingface_hub uses requests/httpx
        transport, timeouts = (), ()
    if isinstance(exc, timeouts + (TimeoutError,)):
        return HubError(
            "unreachable",
            f"Hub at {endpoint} did not answer in time ({what}; SPECOPS_HUB_TIMEOUT sets the limit)",
            repo,
        )
    if isinstance(exc, transport + (ConnectionError, OSError)):
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return HubError("unreachable", f"Hub at {endpoint} is unreachable: {reason}", repo)
    return HubError("error", f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", repo)
