"""Secrets in printed forms: which values are secret, and how they are hidden.

A value is secret when it came from the environment (``${VAR}`` in a profile, unless ``VAR`` is on the
public allow-list), when it sits under a secret-looking name (``server.env`` entries such as ``HF_TOKEN``,
the API key variable), or when it is the password of a URL (``postgres://user:pw@host``).

Hiding is done per value, before any quoting, never by searching printed text for short strings:

- where specops knows the position of a secret (an environment value, a field an error is about, an argv
  element rendered from an interpolated field) the secret part is replaced by ``***`` exactly there;
- elsewhere (engine output lines, text an engine echoes) only values of at least :data:`MIN_SUBSTRING`
  characters are searched for, in their plain, JSON-escaped, Python-repr and shell-quoted spellings. A
  shorter value would match unrelated text, mangle it, and by doing so reveal itself.

Internally a hidden part is written as :data:`MARK` (a NUL, which no argv element or environment value can
contain) until the text is printed: quoting comes after hiding, so a secret with a quote in it cannot be
split by the quoting into pieces that escape the search.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

MASK = "***"
MARK = "\x00"
#: Shorter secrets are hidden only where their position is known (see the module docstring).
MIN_SUBSTRING = 6

#: Variables whose values are never secret and print as they are. Extend it with
#: ``SPECOPS_PUBLIC_VARS=NAME,NAME`` (a name that looks secret, e.g. ``*TOKEN*``, is never public).
PUBLIC_VARS = frozenset(
    {
        "HOME",
        "USER",
        "LOGNAME",
        "PWD",
        "TMPDIR",
        "HOSTNAME",
        "SPECOPS_CACHE",
        "SPECOPS_MODELS",
        "SPECOPS_REAL_MODELS",
        "SPECOPS_STATE",
        "XDG_CACHE_HOME",
        "XDG_STATE_HOME",
    }
)
PUBLIC_VARS_ENV = "SPECOPS_PUBLIC_VARS"

_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|PRIVATE|COOKIE", re.I)
#: Words of a command-line flag that make its value a secret (``--api-key``, ``--hf-token``); a flag that
#: names a file holding the secret (``--api-key-file``, ``--ssl-keyfile``) is fine.
_SECRET_FLAG_WORDS = {
    "token",
    "key",
    "apikey",
    "secret",
    "password",
    "passwd",
    "pass",
    "credential",
    "credentials",
    "auth",
}
_SECRET_SHORT_FLAGS = {"-hft"}  # llama-server's --hf-token
_URL_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)([^\s/?#@:\x00]*)(?::([^\s/?#@\x00]*))?@")
_ASSIGNMENT = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*|[A-Za-z_][A-Za-z0-9_]*)=([^\s,;'\"\x00]+)")


def looks_secret(name: str) -> bool:
    """Environment variable names whose values are redacted in every printed form."""
    return bool(_SECRET_NAME.search(name))


def secret_field(path: tuple[str | int, ...]) -> bool:
    """Profile fields whose value is a secret: ``server.api_key`` and secret-named ``server.env`` entries."""
    path = tuple(path)
    if path == ("server", "api_key"):
        return True
    return len(path) == 3 and path[:2] == ("server", "env") and looks_secret(str(path[2]))


def _secret_word_name(name: str) -> bool:
    """A ``NAME`` in free text whose value is secret: a secret word of its own (``HF_TOKEN``, ``api_key``,
    not ``max_tokens``), or ``*PASSWORD*``/``*PASSWD*``/``*SECRET*`` anywhere in it."""
    words = [w for w in re.split(r"[-_]+", name.lower()) if w]
    return any(w in _SECRET_FLAG_WORDS for w in words) or bool(re.search(r"PASSW(OR)?D|SECRET", name, re.I))


def secret_flag(arg: str) -> str | None:
    """The flag of ``arg`` (``--api-key`` or ``--api-key=...``) when its value would be a secret, else None."""
    if not arg.startswith("-") or arg == "-" or arg[1:2].isdigit():
        return None
    flag = arg.split("=", 1)[0]
    if flag in _SECRET_SHORT_FLAGS:
        return flag
    words = [w for w in re.split(r"[-_]+", flag.lower()) if w]
    if not words or words[-1] in ("file", "path", "dir", "env"):
        return None
    return flag if any(w in _SECRET_FLAG_WORDS for w in words) else None


def public_vars(env: Mapping[str, str] | None) -> frozenset[str]:
    """The allow-list in effect: :data:`PUBLIC_VARS` plus the names listed in ``$SPECOPS_PUBLIC_VARS``."""
    extra = (env or {}).get(PUBLIC_VARS_ENV, "") if env is not None else ""
    names = {n for n in re.split(r"[\s,]+", extra or "") if n}
    return frozenset(n for n in PUBLIC_VARS | names if not looks_secret(n))


@dataclass(frozen=True)
class EnvText:
    """A profile string into which ``${VAR}`` put secret text: the text and where each value landed."""

    path: tuple[str | int, ...]
    text: str
    spans: tuple[tuple[int, int, str], ...]  # (start, end, variable name); only non-empty, non-public values

    def masked(self, mark: str = MARK) -> str:
        out, pos = "", 0
        for start, end, _name in self.spans:
            out += self.text[pos:start] + mark
            pos = end
        return out + self.text[pos:]

    @property
    def values(self) -> list[str]:
        return [self.text[s:e] for s, e, _n in self.spans]


def _variants(value: str, masked: str) -> list[tuple[str, str]]:
    """The spellings a value takes in printed text, each with its masked counterpart."""
    out = [(value, masked)]
    for spell in (lambda s: json.dumps(s)[1:-1], lambda s: repr(s)[1:-1], lambda s: repr(s + '"')[1:-2], shlex.quote):
        try:
            out.append((spell(value), spell(masked).replace("\\x00", MARK).replace("\\u0000", MARK)))
        except Exception:  # pragma: no cover - every spelling is total on str
            continue
    return out


class Redactor:
    """Hides known secret values (long ones anywhere, see the module docstring) and URL passwords."""

    def __init__(self, values: Iterable[str] = (), masks: Iterable[tuple[str, str]] = ()):
        pairs: dict[str, str] = {}
        for value in values:
            if value and len(value) >= MIN_SUBSTRING:
                for needle, repl in _variants(value, MARK):
                    pairs.setdefault(needle, repl)
        for text, masked in masks:
            if text and len(text) >= MIN_SUBSTRING and text != masked:
                for needle, repl in _variants(text, masked):
                    pairs.setdefault(needle, repl)
        self._pairs = pairs
        needles = sorted((n for n in pairs if n), key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, needles))) if needles else None

    def marked(self, text: str) -> str:
        """``text`` with secrets replaced by :data:`MARK`."""
        if self._pattern is not None:
            text = self._pattern.sub(lambda m: self._pairs[m.group(0)], text)
        return redact_patterns(text)

    def __call__(self, text: str) -> str:
        return unmark(self.marked(text))


def redact_patterns(text: str) -> str:
    """Passwords in URLs and values of secret-named ``NAME=value`` / ``--flag=value``, as :data:`MARK`."""
    if "@" in text:

        def url(m: re.Match[str]) -> str:
            if m.group(3) is None:  # https://TOKEN@host: the whole userinfo may be the secret
                return str(m.group(1)) + (MARK if m.group(2) else "") + "@"
            return f"{m.group(1)}{m.group(2)}:{MARK if m.group(3) else ''}@"

        text = _URL_USERINFO.sub(url, text)
    if "=" in text:

        def assign(m: re.Match[str]) -> str:
            name = m.group(1)
            secret = secret_flag(name) if name.startswith("-") else _secret_word_name(name)
            return f"{name}={MARK}" if secret and m.group(2) != MARK else m.group(0)

        text = _ASSIGNMENT.sub(assign, text)
    return text


def unmark(text: str) -> str:
    return text.replace(MARK, MASK)


def shell_quote(marked: str) -> str:
    """``shlex.quote`` of text whose secrets are already hidden; a value that is wholly secret prints as ``***``."""
    if marked == MARK:
        return MASK
    return shlex.quote(unmark(marked))


# ------------------------------------------------------------------------------------------- messages


def _related(a: str, b: str) -> bool:
    """Whether field paths ``a`` and ``b`` (``server.env.X``) are the same or one contains the other."""
    if not a or not b:
        return False
    short, long = sorted((a, b), key=len)
    return long == short or long.startswith(short + ".") or long.startswith(short + "[")


def redact_message(
    message: str, field: str, texts: Iterable[EnvText], format_path: Callable[[tuple[str | int, ...]], str]
) -> str:
    """A problem message about ``field`` with every secret interpolated value hidden.

    Long values are hidden anywhere; a short one only in a problem about its own field, and only where
    the message quotes it (``invalid value 'ab'``, ``ngram.min (9)``), never inside other text: ``a`` in
    "needs a draft" stays, or the message would give the value away.
    """
    texts = list(texts)
    if not texts:
        return redact_patterns(message).replace(MARK, MASK)
    out = Redactor([v for t in texts for v in t.values], [(t.text, t.masked()) for t in texts]).marked(message)
    for t in texts:
        if not _related(format_path(t.path), field):
            continue
        for value, masked in [(t.text, t.masked())] + [(v, MARK) for v in t.values]:
            if not value:
                continue
            for left, right in (("'", "'"), ('"', '"'), ("(", ")")):
                out = out.replace(left + value + right, left + masked + right)
            out = out.replace(repr(value), repr(masked).replace("\\x00", MARK))
    return unmark(out)
