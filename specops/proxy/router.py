"""Which engine serves a request, when a profile keeps twins warm beside its primary. Pure: no I/O, no clock.

The order, first that speaks wins:

1. the client's ``X-Specops-Speculation: on|off|auto`` header (a malformed or unknown value: 400 with a one-line
   reason; any value when ``routing.client_choice: forbid``: 403); ``auto`` passes on to the next;
2. a model alias (``routing.aliases``): the body's ``model`` names one; the operator's own names, so they hold
   under ``client_choice: forbid`` too. Whatever decides, a request naming an alias is sent with the engine's own
   model name (:attr:`Route.body`), and ``/v1/models`` lists the aliases (:meth:`Router.list_aliases`);
3. the profile's route rules (path, ``model``, a header, a pattern on the system prompt), in order; a rule
   saying ``auto`` passes on;
4. above the measured crossover load (the goodput surface: the decider sets :attr:`Router.load_off`), every
   request goes to the engine without speculation (``load``);
5. the choice learned for the request's class (``routing.classes``): the decider's verdict on its acceptance
   window, with a small share explored on the other engine; a class not decided yet is measured on the
   speculating engine (with ``learn: one_at_a_time`` one such class at a time: the others wait on the engine
   without speculation, ``class-waiting``, and no decided class explores onto the speculating engine meanwhile).
   When clients may not choose (``client_choice: forbid``), a new class enters the table only as
   :meth:`~specops.watch.classes.ClassTable.admits` allows; until then it takes the default route
   (``class-default``), so a fresh class key per request is no way onto the speculating engine;
6. the step in effect (the primary, or the twin a fallback switched to).

While a new draft is measured on live traffic (``routing.canary``), a share of the requests placed on the
speculating primary by any of these goes to the canary engine instead (``canary``), evenly spread.

``on`` means a speculating engine (the one in effect if it speculates, else the first that does); ``off`` an
engine without speculation (the ``none`` twin). An engine that is not live does not get traffic: the request goes
to a live one (``failover``); with none live the proxy's queue holds it, as it always did.

The body is parsed only when an alias, a rule or the class key needs it (``model``, the system prompt): routing runs
on every request (``benchmarks/bench_router.py`` measures it). Client text meets a rule's pattern only through RE2
(linear time) and only its first :data:`~specops.config.routing.SYSTEM_MATCHED` characters, so no request can hold
the event loop; a class key is kept as sent only when it is short and plain (:func:`class_name`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from specops.config.routing import (
    SPECULATION_HEADER,
    SPECULATION_VALUES,
    SYSTEM_MATCHED,
    RouteMatch,
    Routing,
    system_pattern,
)
from specops.watch.classes import ClassTable

#: Longest class key kept as sent (a header value, model name or path); a longer one is named by its hash.
MAX_KEY = 64
#: What a class key kept as sent may hold: it becomes a Prometheus label and a line of `specops status`.
_PLAIN_KEY = re.compile(rf"[A-Za-z0-9._:/-]{{1,{MAX_KEY}}}")


class RouteRefused(Exception):
    """A request the router refuses: ``status`` (400 malformed header, 403 client choice forbidden), one line."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclass(frozen=True)
class EngineInfo:
    """One engine behind the proxy: its chain step, method, and whether it speculates."""

    step: int  # index in the profile's steps (0: the primary)
    method: str
    speculative: bool
    remote: str | None = None  # a remote twin's URL (another deployment stands for the step), else None


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request goes, and why (for metrics, the class window and the ``route`` events)."""

    engine: int | None  # position in the router's engines; None: no engine is live (the proxy's queue waits)
    asked: str  # "on" | "off" | "default"
    # header | alias | rule N | load | class | class-explore | class-learning | class-waiting | class-default |
    # default | canary
    # (+ " failover")
    reason: str
    key: str | None = None  # the request's class (learned routing), else None
    start: float = 0.0  # when it was routed (the clock the caller passed): a class's tokens/s counts from here
    body: bytes | None = None  # the body to send instead (a model alias replaced by the served name), else None
    lists_models: bool = False  # GET /v1/models with aliases: the answer gets them added (list_aliases)


class _Request:
    """The parts of a request the rules look at; the JSON body is parsed at most once, when first needed."""

    __slots__ = ("_json", "body", "headers", "path")

    def __init__(self, path: str, headers: Mapping[str, str], body: bytes):
        self.path, self.headers, self.body = path, headers, body
        self._json: Any = _UNPARSED

    @property
    def json(self) -> dict:
        if self._json is _UNPARSED:
            try:
                obj = json.loads(self.body) if self.body[:1] in (b"{", b" ", b"\n", b"\t", b"\r") else None
            except (ValueError, UnicodeDecodeError, RecursionError):
                obj = None
            self._json = obj if isinstance(obj, dict) else {}
        return self._json

    @property
    def model(self) -> str | None:
        m = self.json.get("model")
        return m if isinstance(m, str) else None

    @property
    def system(self) -> str | None:
        """The system prompt: the chat ``messages`` with role ``system`` (text parts joined), or a ``system`` field."""
        body = self.json
        found = []
        messages = body.get("messages")
        if isinstance(messages, list):
            for msg in messages:
                if isinstance(msg, dict) and msg.get("role") == "system":
                    found.append(_text(msg.get("content")))
        elif isinstance(body.get("system"), (str, list)):
            found.append(_text(body["system"]))
        return "\n".join(found) if found else None


_UNPARSED = object()


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _matches(m: RouteMatch, req: _Request, pattern) -> bool:
    if m.path is not None:
        if m.path.endswith("*"):
            if not req.path.startswith(m.path[:-1]):
                return False
        elif req.path != m.path:
            return False
    if m.header is not None:
        value = req.headers.get(m.header)
        if value is None or (m.value is not None and value != m.value):
            return False
    if m.model is not None and req.model != m.model:
        return False
    if pattern is not None:
        system = req.system
        if system is None or pattern.search(system[:SYSTEM_MATCHED].encode("utf-8", "replace")) is None:
            return False
    return True


def class_name(value: str) -> str:
    """A class key as the table, the metrics' labels and status name it: the client's text when it is at most
    :data:`MAX_KEY` characters of ``A-Za-z0-9._:/-``, else ``h:`` and 12 hex digits of its hash (stable, so the
    class is the same on every request; a client's odd bytes never reach a label or a terminal)."""
    if _PLAIN_KEY.fullmatch(value):
        return value
    return "h:" + hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()


class Router:
    """Decides per request among ``engines`` (the primary first, then the twins in chain order)."""

    def __init__(self, routing: Routing, engines: Sequence[EngineInfo], classes: ClassTable | None = None):
        if not engines:
            raise ValueError("a router needs at least one engine")
        self.routing = routing
        self.engines = tuple(engines)
        self.current = 0  # the engine of the step in effect (the decider's): the default route
        self.load_off = False  # the decider: the live load is past the measured crossover (every class to off)
        self.allow_client = routing.client_choice == "allow"
        self._rules = [
            (i, r, system_pattern(r.match.system) if r.match.system else None) for i, r in enumerate(routing.rules)
        ]
        key = routing.classes.key
        self.class_key = None if key == "none" else key
        #: one undecided class at a time on the speculating engine (``routing.classes.learn: one_at_a_time``)
        self.learn_alone = routing.classes.learn == "one_at_a_time"
        self.classes = classes if self.class_key is not None else None
        if self.class_key is not None and self.classes is None:
            c = routing.classes
            self.classes = ClassTable(c.max_classes, c.window, c.explore)
        self.aliases = dict(routing.aliases)
        #: the model name the engines serve, written over an alias (the run layer sets it from the launch plan)
        self.served: str | None = None
        self.on_engine = next((i for i, e in enumerate(self.engines) if e.speculative), 0)
        self.off_engine = next((i for i, e in enumerate(self.engines) if not e.speculative), len(self.engines) - 1)
        #: the canary engine's position (the last engine) while a new draft is measured, else None
        self.canary: int | None = None
        self.canary_share = 0.0
        self._canary_credit = 0.0

    def start_canary(self, info: EngineInfo, share: float) -> int:
        """Add the canary engine (last) and send it ``share`` of the requests placed on the speculating primary;
        returns its position."""
        if self.canary is not None:
            raise ValueError("a canary is already routed")
        self.engines = (*self.engines, info)
        self.canary, self.canary_share, self._canary_credit = len(self.engines) - 1, float(share), 0.0
        return self.canary

    def end_canary(self) -> None:
        """No more requests to the canary; its engine leaves the router (requests in flight finish there)."""
        if self.canary is not None:
            self.engines = self.engines[: self.canary] + self.engines[self.canary + 1 :]
            self.canary = None

    def engine_for_step(self, step: int) -> int | None:
        """The engine running chain step ``step`` (None: no twin runs it; never the canary)."""
        return next((i for i, e in enumerate(self.engines) if e.step == step and i != self.canary), None)

    # ------------------------------------------------------------------------------------------ the decision
    def route(
        self, path: str, headers: Mapping[str, str], body: bytes, live: Sequence[bool], now: float = 0.0
    ) -> Route:
        """The engine for one request (``path`` without the query; ``live[i]``: engine i takes requests now).
        Raises :class:`RouteRefused` for a header the profile refuses or that is not on/off/auto."""
        req = _Request(path, headers, body)
        alias = None
        if self.aliases:
            alias = req.model
            if alias not in self.aliases:
                alias = None
        asked, reason, key = self._asked(req, alias, now)
        route = self._place(asked, reason, key, live, now)
        if alias is not None and self.served is not None:
            route = replace(route, body=_with_model(req.json, self.served))
        elif self.aliases and path == "/v1/models":
            route = replace(route, lists_models=True)
        return route

    def default_route(self, live: Sequence[bool], now: float = 0.0) -> Route:
        """The route of a request that is not routed (``/health``): the step in effect, else a live engine."""
        return self._place("default", "default", None, live, now)

    def list_aliases(self, answer: bytes) -> bytes | None:
        """An engine's ``/v1/models`` answer with one entry per alias added (after the served model's), or None
        when it is not the OpenAI list shape (then it is passed on as it came)."""
        try:
            doc = json.loads(answer)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
        data = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(data, list):
            return None
        served = next((m for m in data if isinstance(m, dict) and m.get("id") == self.served), None)
        if served is None:
            served = next((m for m in data if isinstance(m, dict)), {})
        known = {m.get("id") for m in data if isinstance(m, dict)}
        for name, speculation in self.aliases.items():
            if name not in known:
                entry = {"id": name, "object": "model", "owned_by": "specops", "root": served.get("id")}
                if isinstance(served.get("created"), int):
                    entry["created"] = served["created"]
                entry["specops_speculation"] = speculation
                data.append(entry)
        return json.dumps(doc).encode()

    def _asked(self, req: _Request, alias: str | None, now: float) -> tuple[str, str, str | None]:
        raw = req.headers.get(SPECULATION_HEADER)
        if raw is not None:
            if not self.allow_client:
                raise RouteRefused(
                    403,
                    "specops_speculation_forbidden",
                    f"{SPECULATION_HEADER}: this deployment does not let clients choose (routing.client_choice: forbid)",
                )
            value = raw.strip().lower()
            if value not in SPECULATION_VALUES:
                raise RouteRefused(
                    400,
                    "specops_bad_speculation_header",
                    f"{SPECULATION_HEADER}: {_shown(raw)} is not one of on, off, auto",
                )
            if value != "auto":
                return value, "header", None
        if alias is not None:
            said = self.aliases[alias]
            if said != "auto":
                return said, "alias", None
        for i, rule, pattern in self._rules:
            if _matches(rule.match, req, pattern):
                if rule.speculation != "auto":
                    return rule.speculation, f"rule {i}", None
                break
        key = None
        if self.classes is not None:
            key = self._class_key(req)
            if not self.allow_client and not self.classes.admits(key, now):
                key = None  # a new class the table has no room to learn now: the default route (module docstring)
        if self.load_off:
            if key is not None:
                self.classes.touch(key, now).requests += 1
            return "off", "load", key
        if key is not None:
            c = self.classes
            explore = c.explores(key, now)
            verdict = c.get(key).speculate  # touched by explores()
            if verdict is None:
                if self.learn_alone and not c.learning_turn(key, now):
                    return "off", "class-waiting", key
                return "on", "class-learning", key
            if explore and not (self.learn_alone and not verdict and c.learner(now) is not None):
                return ("off" if verdict else "on"), "class-explore", key
            return ("on" if verdict else "off"), "class", key
        return "default", ("default" if self.classes is None else "class-default"), None

    def _class_key(self, req: _Request) -> str:
        kind = self.class_key
        if kind == "header":
            value = req.headers.get(self.routing.classes.header or "")
        elif kind == "model":
            value = req.model
        elif kind == "route":
            value = req.path
        else:  # system
            s = req.system
            value = (
                None if s is None else "sys-" + hashlib.blake2b(s.encode("utf-8", "replace"), digest_size=6).hexdigest()
            )
        return "-" if not value else class_name(value)

    def _place(self, asked: str, reason: str, key: str | None, live: Sequence[bool], now: float) -> Route:
        if asked == "on":
            want = self.current if self.engines[self.current].speculative else self.on_engine
        elif asked == "off":
            want = self.current if not self.engines[self.current].speculative else self.off_engine
        else:
            want = self.current
        if live[want]:
            canary = self.canary
            if want == 0 and canary is not None and live[canary] and self.engines[0].speculative:
                self._canary_credit += self.canary_share
                if self._canary_credit >= 1.0:
                    self._canary_credit -= 1.0
                    return Route(canary, asked, "canary", key, now)
            return Route(want, asked, reason, key, now)
        # the engine asked for is not live: the step in effect if it is, else the first live one
        for i in (self.current, *range(len(self.engines))):
            if live[i]:
                return Route(i, asked, reason + " failover", key, now)
        return Route(None, asked, reason, key, now)


def _with_model(body: dict, served: str) -> bytes:
    """The request body with ``model`` set to the engine's served name (serialized again: the engine reads the
    same JSON object; ASCII escapes keep any text the client sent valid)."""
    return json.dumps({**body, "model": served}, separators=(",", ":")).encode()


def _shown(text: str) -> str:
    """A client's header value, safe to echo in one line (printable ASCII, at most 32 characters)."""
    safe = "".join(ch if " " <= ch <= "~" else "?" for ch in text[:32])
    return repr(safe + ("…" if len(text) > 32 else ""))
