"""Secrets written into a profile's text: refused, so that no render (a ConfigMap included) carries one.

A profile is kept in git, copied whole into a ConfigMap by ``specops k8s render`` and printed by renders;
a secret belongs in the environment (``${VAR}``; in Kubernetes a Secret the pods read). Three ways of
writing one anyway are refused, each located at the value, in every file of the profile (a base that
``extends`` names included, even where an overlay replaces the value):

- a non-empty default of a secret, ``${VAR:-literal}``, on a secret field (``server.api_key``, a
  secret-named ``server.env`` entry: :func:`specops.redact.secret_field`) or of a secret-named variable
  (``${HF_TOKEN:-…}`` anywhere): the default is the secret, written in the profile;
- a password in a URL (``postgres://user:pw@db``), anywhere; a password made only of ``${VAR}``
  references (no default) is fine: the environment fills it in;
- a variable that is not public (:func:`specops.redact.public_vars`) in ``server.extra_args``: specops
  treats its value as a secret (renders print ``***``), yet the engine's command line is readable by every
  user in ``ps``. A variable that is no secret may be listed in ``SPECOPS_PUBLIC_VARS``; a secret-named one
  never can, so it goes into ``server.env`` (the engine reads its variable) or ``server.api_key``.

No message quotes the value, not even a default (it is the secret).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from specops.config.located import ENV_REFERENCE, RawText, format_path
from specops.errors import Problem
from specops.redact import looks_secret, secret_field

#: Where a reference without a default stood (the environment fills it; it is no text of the profile).
_FROM_ENV = "\x00"
#: ``scheme://user:password@``; group 1 is the password.
_URL_PASSWORD = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/?#@:]*:([^\s/?#@]*)@")


def credential_problems(raw_texts: Iterable[RawText]) -> list[Problem]:
    """Every secret written into the profile's text (see the module docstring), located at its value."""
    out: list[Problem] = []
    for raw in raw_texts:
        for message in dict.fromkeys(_findings(raw)):
            problem = Problem(raw.location, format_path(raw.path), message)
            if problem not in out:  # one file read twice (two overlays extending one base) says it once
                out.append(problem)
    return out


def _findings(raw: RawText) -> Iterator[str]:
    secret = secret_field(raw.path)
    for m in ENV_REFERENCE.finditer(raw.text):
        name, default = m.group(1), m.group(2)
        if name and default and (secret or looks_secret(name)):
            what = "of a secret field" if secret else "of a secret-named variable"
            yield (
                f"${{{name}:-…}}: the default {what} is a secret written into the profile (and into every "
                f"render, a ConfigMap included): write ${{{name}}} (or ${{{name}:-}} for none) and set the "
                "variable where the profile runs"
            )
    if has_url_password(raw.text):
        yield (
            "a password in a URL would be written into every render (a ConfigMap included): write the "
            "password as a ${VAR} reference that the environment fills in"
        )
    if raw.path[:2] == ("server", "extra_args"):
        for name in raw.private_vars:
            if looks_secret(name):
                yield (
                    f"${{{name}}} would put a secret on the engine's command line, which every user can read "
                    "in `ps`: pass it in server.env (the engine reads its variable) or server.api_key"
                )
            else:
                yield (
                    f"${{{name}}} is not a public variable, so specops treats its value as a secret, yet the "
                    "engine's command line is readable by every user in `ps`: list it in SPECOPS_PUBLIC_VARS "
                    "if it is no secret, else pass it in server.env"
                )


def has_url_password(text: str) -> bool:
    """Whether ``text`` as written holds a URL whose password is text of its own (not only ``${VAR}``)."""
    if "@" not in text:
        return False

    def written(m: re.Match[str]) -> str:
        if not m.group(1):  # `$$`
            return "$"
        return m.group(2) if m.group(2) else _FROM_ENV  # a default is text written in the profile

    plain = ENV_REFERENCE.sub(written, text)
    return any(m.group(1).replace(_FROM_ENV, "") for m in _URL_PASSWORD.finditer(plain))
