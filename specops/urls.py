"""URLs that specops prints or calls: how they are shown (secrets hidden) and which ones are accepted.

:func:`redact_url` is applied wherever a URL is printed (watch output, window reasons that end up in the
event log and ``specops status``, error messages). It hides:

- the userinfo (``https://user:pw@host`` → ``https://***@host``);
- every query value (``?token=abc&model=x`` → ``?token=***&model=***``): a value's name does not say
  reliably whether it is a secret (``sig``, ``code``, ``X-Amz-Signature``, ``key``...), so none is shown;
- a fragment (``#access_token=...`` → ``#***``);
- path segments that look like tokens (20 or more of ``[A-Za-z0-9_-]`` with at least two digits and two
  letters and no dot), as in ``https://hooks.slack.com/services/T0/B0/<secret>`` webhooks.

:func:`redact_text` does the same to every ``scheme://…`` inside free text (an exception's message).
:func:`check_http_url` accepts only ``http``/``https`` URLs with a host, no whitespace or control
characters, and a valid port; its error message shows the URL redacted.

Pure standard library, no imports from the rest of specops, so any module may use it.
"""

from __future__ import annotations

import re
from urllib.parse import SplitResult, unquote, urlsplit, urlunsplit

MASK = "***"
MAX_URL_LENGTH = 4096
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,15}://[^\s'\"<>`]+")
_TOKEN_SEGMENT = re.compile(r"[A-Za-z0-9_-]{20,}")
_CONTROL = re.compile(r"[\x00-\x20\x7f]")


def _token_like(segment: str) -> bool:
    if not _TOKEN_SEGMENT.fullmatch(segment):
        return False
    digits = sum(c.isdigit() for c in segment)
    letters = sum(c.isalpha() for c in segment)
    return digits >= 2 and letters >= 2


def _redact_query(query: str) -> str:
    out = []
    for part in query.split("&"):
        name, eq, _value = part.partition("=")
        out.append(part if not part else f"{name}={MASK}" if eq else MASK)
    return "&".join(out)


def redact_url(url: str) -> str:
    """``url`` with its userinfo, query values, fragment and token-like path segments replaced by ``***``."""
    if not isinstance(url, str):
        return MASK
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. a malformed IPv6 host: keep the scheme only
        scheme = url.split("://", 1)[0] if "://" in url else ""
        return f"{scheme}://{MASK}" if scheme.isalnum() else MASK
    netloc = parts.netloc
    if "@" in netloc:
        netloc = MASK + "@" + netloc.rpartition("@")[2]
    path = "/".join(MASK if _token_like(seg) else seg for seg in parts.path.split("/"))
    fragment = MASK if parts.fragment else ""
    shown = urlunsplit(SplitResult(parts.scheme, netloc, path, _redact_query(parts.query), fragment))
    if parts.query == "" and url.rstrip("#").endswith("?"):
        shown += "?"
    return _CONTROL.sub(lambda m: repr(m.group(0))[1:-1], shown)


def redact_text(text: str) -> str:
    """``text`` with every URL in it redacted (see :func:`redact_url`)."""
    if not isinstance(text, str) or "://" not in text:
        return text

    def one(m: re.Match[str]) -> str:
        url: str = m.group(0)
        core = url.rstrip(".,;:!?)]}")  # punctuation that ends a sentence, not the URL
        return redact_url(core) + url[len(core) :]

    return _URL_IN_TEXT.sub(one, text)


def url_problem(url: object) -> str | None:
    """Why ``url`` is not an ``http``/``https`` URL with a host (None when it is)."""
    if not isinstance(url, str) or not url:
        return "empty"
    if len(url) > MAX_URL_LENGTH:
        return f"longer than {MAX_URL_LENGTH} characters"
    if _CONTROL.search(url):
        return "contains whitespace or a control character"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as exc:
        return f"not a valid URL ({exc})"
    if parts.scheme.lower() not in ("http", "https"):
        return (
            f"only http:// and https:// URLs are accepted, not {parts.scheme + ':' if parts.scheme else 'a bare path'}"
        )
    if not parts.hostname:
        return "has no host"
    return None


def check_http_url(url: object, what: str = "URL") -> str:
    """``url`` when it is an ``http``/``https`` URL with a host; raises ValueError (URL shown redacted)."""
    problem = url_problem(url)
    if problem is not None:
        shown = redact_url(url) if isinstance(url, str) else repr(url)
        raise ValueError(f"{what} {shown}: {problem}")
    return url  # type: ignore[return-value]


def split_userinfo(url: str) -> tuple[str, tuple[str, str] | None]:
    """``url`` without its userinfo, and ``(user, password)`` decoded from it (None when there was none).

    urllib does not send a URL's userinfo; a caller that wants it as Basic auth sends it as a header."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=host)), (unquote(user), unquote(password))


def http_url(host: str, port: int) -> str:
    """The URL a local client uses for a bind address (a wildcard bind is reached on loopback)."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"
