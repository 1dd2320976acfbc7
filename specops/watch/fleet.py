"""The fleet view: every replica of a deployment as Prometheus sees it, and the fleet added up.

Replicas of one profile (pods on Kubernetes, or plain servers scraped by one Prometheus) each export
specops' own ``/specops/metrics``; ``specops status --fleet URL`` asks Prometheus, not the replicas, so it
works from anywhere Prometheus answers. Each signal is one instant query grouped by the replica label
(``pod`` by default), so an empty answer names the query that returned nothing.

Per replica: the active method (``specops_active_method == 1``), the supervisor's state, acceptance over
the window (the drafted and accepted counters' increases; without them, the watcher's own window gauges),
the mean acceptance length and tokens/s of the watcher's last window, the proxy's in-flight and queued
requests, switches in the window, ``up``, and any ``specops_switch_*`` gauge the fleet's switch
coordination exports (a replica waiting for a switch slot). The fleet line: replicas up, methods with
their counts, acceptance weighted by drafted tokens, and totals.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from specops.config.durations import format_duration
from specops.errors import SpecopsError
from specops.terminal import one_line
from specops.urls import redact_text, redact_url
from specops.watch.sources import promql_duration

#: Seconds one query may take.
TIMEOUT = 5.0
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*")\s*(?:,|\Z)')
#: The fleet switch coordination's gauges (``specops_switch_waiting``, ``specops_switch_slot_held``), not its
#: counters nor the ``specops_switch_duration_seconds`` histogram; absent where coordination is off.
SWITCH_GAUGES = "specops_switch_.+"
SWITCH_NOT = "specops_switch_duration_seconds.*|.+_total|.+_created"


class FleetError(SpecopsError):
    """Prometheus could not be asked, or what it answered shows no fleet; says which query and why."""


def parse_selector(text: str | None) -> list[str]:
    """``namespace="llm",job=~"spec.*"`` as a list of PromQL label matchers; a located error otherwise."""
    if text is None or not text.strip():
        return []
    body, shift = text, 0
    if body.strip().startswith("{") and body.strip().endswith("}"):
        shift = body.index("{") + 1
        body = body[shift : body.rindex("}")]
    out, pos = [], 0
    while body[pos:].strip():
        m = _MATCHER.match(body, pos)
        if m is None:
            pos += len(body[pos:]) - len(body[pos:].lstrip())
            raise FleetError(
                f'--selector: column {shift + pos + 1}: expected LABEL="value" (or !=, =~, !~), '
                f"comma-separated, at {body[pos : pos + 40]!r}"
            )
        out.append(f"{m.group(1)}{m.group(2)}{m.group(3)}")
        pos = m.end()
    return out


def check_label(name: str, option: str = "--by") -> str:
    if not _NAME.match(name or ""):
        raise FleetError(f"{option}: {name!r} is not a Prometheus label name (letters, digits, '_'; e.g. pod)")
    return name


@dataclass(frozen=True)
class FleetQueries:
    """The PromQL the fleet view runs, by signal (``by``: the replica label; ``matchers``: the selector)."""

    by: str
    matchers: tuple[str, ...]
    window_s: float

    def sel(self, *extra: str) -> str:
        parts = [*extra, *self.matchers]
        return "{" + ",".join(parts) + "}" if parts else ""

    def all(self) -> dict[str, str]:
        b, s, w = self.by, self.sel(), promql_duration(self.window_s)
        fb = "specops_fallbacks_total" + s
        return {
            "up": f"max by ({b}) (up{s})",
            "method": f"max by ({b}, method) (specops_active_method{s}) == 1",
            "state": f"max by ({b}, state) (specops_supervisor_state{s}) == 1",
            "drafted": f"sum by ({b}) (increase(specops_draft_tokens_seen_total{s}[{w}]))",
            "accepted": f"sum by ({b}) (increase(specops_accepted_tokens_seen_total{s}[{w}]))",
            "window_acceptance": f"avg by ({b}) (specops_acceptance_rate{s} >= 0)",
            "window_drafted": f"sum by ({b}) (specops_window_draft_tokens{s})",
            "mean_acceptance_length": f"avg by ({b}) (specops_mean_acceptance_length{s} >= 0)",
            "tokens_per_s": f"sum by ({b}) (specops_tokens_per_second{s} >= 0)",
            "in_flight": f"sum by ({b}) (specops_proxy_in_flight{s})",
            "queue": f"sum by ({b}) (specops_proxy_queue_depth{s})",
            # a switch counter born inside the window has no sample `offset w`: count it from 0 (increase()
            # would miss its first switch, which is most often the only one)
            "switches": f"sum by ({b}) (clamp_min({fb} - ({fb} offset {w} or {fb} * 0), 0))",
            "switch_gauges": f'{{__name__=~"{SWITCH_GAUGES}",__name__!~"{SWITCH_NOT}"'
            + "".join("," + m for m in self.matchers)
            + "}",
        }


#: Queries whose empty answer means "none" rather than "not exported".
ZERO_WHEN_EMPTY = ("switches", "switch_gauges", "drafted", "accepted")
#: Queries whose empty answer means no replica exports specops' metrics at all.
SPECOPS_PRESENT = ("method", "state", "in_flight")


class PrometheusQueries:
    """Runs instant queries through prometheus-api-client, with no retries (a dead server fails fast)."""

    def __init__(self, url: str, timeout: float = TIMEOUT):
        self.url = url.rstrip("/")
        self.shown_url = redact_url(self.url)
        self.timeout = timeout
        self._client: Any = None

    def query(self, name: str, expr: str, at: float | None = None) -> list[dict]:
        """One instant query, evaluated at ``at`` (Prometheus' clock, Unix seconds) or now."""
        import requests
        from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
        from urllib3.util.retry import Retry

        if self._client is None:
            self._client = PrometheusConnect(
                url=self.url, retry=Retry(total=0, connect=0, read=0, redirect=0, status=0), timeout=self.timeout
            )
        try:
            result = self._client.custom_query(expr, params={"time": repr(at)} if at is not None else None)
        except PrometheusApiClientException as exc:
            raise FleetError(
                f"Prometheus {self.shown_url} refused the {name} query `{expr}`: {redact_text(str(exc))[:300]}"
            ) from None
        except requests.RequestException as exc:
            raise FleetError(f"Prometheus {self.shown_url} unreachable: {type(exc).__name__}") from None
        except ValueError as exc:
            raise FleetError(f"Prometheus {self.shown_url}: bad answer ({redact_text(str(exc))[:200]})") from None
        if not isinstance(result, list):
            raise FleetError(f"Prometheus {self.shown_url}: unexpected answer to `{expr}`")
        return result

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _value(item: dict) -> float | None:
    try:
        v = float(item["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _eval_time(items: list[dict]) -> float | None:
    try:
        return float(items[0]["value"][0]) if items else None
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def _labels_seen(items: Iterable[dict]) -> list[str]:
    return sorted({k for it in items for k in (it.get("metric") or {}) if k != "__name__"})


def aggregate(by: str, answers: dict[str, list[dict]], queries: dict[str, str]) -> dict:
    """The fleet view from the raw answers (Prometheus' result lists by query name): pure, no I/O.

    Raises :class:`FleetError` naming the query when ``up`` matched nothing, when the targets lack the
    replica label, or when no target exports specops' metrics.
    """
    up = answers.get("up") or []
    if not up:
        raise FleetError(f"no scrape target matches: `{queries['up']}` returned nothing (check --selector and --by)")
    if all(by not in (it.get("metric") or {}) for it in up):
        raise FleetError(
            f"the targets have no {by!r} label (`{queries['up']}`); labels they have: "
            f"{', '.join(_labels_seen(answers.get('raw_up') or up)) or 'none'}: pass --by LABEL"
        )
    if not any(answers.get(q) for q in SPECOPS_PRESENT):
        shown = "; ".join(f"`{queries[q]}`" for q in SPECOPS_PRESENT)
        raise FleetError(
            f"{len(up)} target(s) match but none exports specops' metrics: {shown} returned nothing "
            "(is /specops/metrics scraped, e.g. by the PodMonitor `specops k8s render` writes?)"
        )
    rows: dict[str, dict] = {}

    def row(item: dict) -> dict | None:
        key = (item.get("metric") or {}).get(by)
        if key is None:
            return None
        return rows.setdefault(key, {"replica": key, "up": False, "methods": [], "switch_gauges": {}})

    for item in up:
        r = row(item)
        if r is not None:
            r["up"] = (_value(item) or 0) >= 1
    for name, items in answers.items():
        if name in ("up", "raw_up"):
            continue
        for item in items:
            r = row(item)
            if r is None:
                continue
            labels = item.get("metric") or {}
            if name == "method":
                r["methods"] = sorted({*r["methods"], labels.get("method", "?")})
            elif name == "state":
                r["state"] = labels.get("state")
            elif name == "switch_gauges":
                gauge = labels.get("__name__", "specops_switch_?").removeprefix("specops_switch_")
                r["switch_gauges"][gauge] = _value(item)
            else:
                r[name] = _value(item)
    replicas = [_finish(rows[k]) for k in sorted(rows)]
    empty = [q for q in queries if q not in ZERO_WHEN_EMPTY and not answers.get(q)]
    return {
        "by": by,
        "replicas": replicas,
        "fleet": fleet_line(replicas),
        "queries": dict(queries),
        "empty_queries": empty,
    }


def _finish(r: dict) -> dict:
    """One replica: acceptance from the counters when they moved, else from the watcher's window."""
    drafted, accepted = r.pop("drafted", None), r.pop("accepted", None)
    wa, wd = r.pop("window_acceptance", None), r.pop("window_drafted", None)
    if drafted and drafted > 0 and accepted is not None:
        r["acceptance"], r["draft_tokens"], r["acceptance_from"] = accepted / drafted, drafted, "counters"
    elif wa is not None:
        r["acceptance"], r["draft_tokens"], r["acceptance_from"] = wa, wd or 0.0, "watcher window"
    else:
        r["acceptance"], r["draft_tokens"], r["acceptance_from"] = None, drafted or wd or 0.0, None
    r["method"] = ",".join(r["methods"]) if r["methods"] else None
    r["switches"] = round(r.get("switches") or 0)
    r["waiting_for_switch_slot"] = (r["switch_gauges"].get("waiting") or 0) > 0
    r["holds_switch_slot"] = (r["switch_gauges"].get("slot_held") or 0) > 0
    for k in ("mean_acceptance_length", "tokens_per_s", "in_flight", "queue", "state"):
        r.setdefault(k, None)
    return r


def fleet_line(replicas: list[dict]) -> dict:
    """The fleet added up: acceptance weighted by each replica's drafted tokens (Σ a·d / Σ d)."""
    up = [r for r in replicas if r["up"]]
    methods: dict[str, int] = {}
    for r in up:
        key = r["method"] or "unknown"
        methods[key] = methods.get(key, 0) + 1
    weighted = [(r["acceptance"], r["draft_tokens"]) for r in up if r["acceptance"] is not None and r["draft_tokens"]]
    total_d = sum(d for _, d in weighted)

    def total(key: str) -> float | None:
        vals = [r[key] for r in up if r.get(key) is not None]
        return sum(vals) if vals else None

    return {
        "replicas": len(replicas),
        "up": len(up),
        "down": [r["replica"] for r in replicas if not r["up"]],
        "methods": dict(sorted(methods.items())),
        "acceptance": sum(a * d for a, d in weighted) / total_d if total_d > 0 else None,
        "draft_tokens": total_d,
        "tokens_per_s": total("tokens_per_s"),
        "in_flight": total("in_flight"),
        "queue": total("queue"),
        "switches": sum(r["switches"] for r in replicas),
        "waiting_for_switch_slot": [r["replica"] for r in up if r["waiting_for_switch_slot"]],
        "holding_switch_slot": [r["replica"] for r in up if r["holds_switch_slot"]],
    }


def read_fleet(
    url: str,
    by: str = "pod",
    matchers: Iterable[str] = (),
    window_s: float = 300.0,
    client: PrometheusQueries | None = None,
) -> dict:
    """Ask Prometheus at ``url`` for every signal and return :func:`aggregate`'s view (with ``prometheus``)."""
    check_label(by)
    queries = FleetQueries(by, tuple(matchers), window_s).all()
    prom = client or PrometheusQueries(url)
    try:
        # every query at the instant Prometheus evaluated the first one: one consistent view (counters
        # read at two instants would not divide into a true ratio)
        answers = {"up": prom.query("up", queries["up"])}
        at = _eval_time(answers["up"])
        answers.update({n: prom.query(n, e, at) for n, e in queries.items() if n != "up"})
        if answers["up"] and all(by not in (it.get("metric") or {}) for it in answers["up"]):
            sel = FleetQueries(by, tuple(matchers), window_s).sel()
            answers["raw_up"] = prom.query("up", f"up{sel}", at)  # to name the labels the targets do have
    finally:
        if client is None:
            prom.close()
    view = aggregate(by, answers, queries)
    view["prometheus"] = prom.shown_url
    view["window_s"] = window_s
    return view


# ------------------------------------------------------------------------------------------------ text


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def fleet_text(view: dict) -> list[str]:
    """The view as a table, one line per replica, then the fleet line and what returned nothing."""
    by = view["by"]
    head = (
        by,
        "up",
        "method",
        "state",
        "accept",
        "from",
        "mean len",
        "tok/s",
        "in flight",
        "queue",
        "switches",
        "switch slot",
    )
    rows = []
    for r in view["replicas"]:
        slot = "waiting" if r["waiting_for_switch_slot"] else "held" if r["holds_switch_slot"] else "-"
        rows.append(
            (
                one_line(r["replica"], 64),
                "up" if r["up"] else "DOWN",
                one_line(r["method"] or "-", 64),
                one_line(r["state"] or "-", 32),
                _f(r["acceptance"], ".3f"),
                one_line(r["acceptance_from"] or "-", 32),
                _f(r["mean_acceptance_length"], ".2f"),
                _f(r["tokens_per_s"], ".1f"),
                _f(r["in_flight"], ".0f"),
                _f(r["queue"], ".0f"),
                str(r["switches"]),
                slot,
            )
        )
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in (head, *rows)]
    f = view["fleet"]
    methods = ", ".join(f"{one_line(m, 64)} ×{n}" for m, n in f["methods"].items()) or "none"
    window = format_duration(view.get("window_s", 300.0))
    out.append(
        f"fleet: {f['up']}/{f['replicas']} up; methods {methods}; acceptance {_f(f['acceptance'], '.3f')} "
        f"(weighted by {f['draft_tokens']:.0f} drafted tokens); tokens/s {_f(f['tokens_per_s'], '.1f')}; "
        f"in flight {_f(f['in_flight'], '.0f')}, queued {_f(f['queue'], '.0f')}; switches in {window}: "
        f"{f['switches']}"
    )
    if f["down"]:
        out.append(f"down: {', '.join(one_line(r, 64) for r in f['down'])}")
    if f["waiting_for_switch_slot"]:
        out.append(f"waiting for a switch slot: {', '.join(one_line(r, 64) for r in f['waiting_for_switch_slot'])}")
    for q in view.get("empty_queries", []):
        out.append(f"no data: {q} (`{view['queries'][q]}` returned nothing)")
    return out
