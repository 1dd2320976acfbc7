"""Where acceptance is read from: the engine's ``/metrics``, a Prometheus server, or llama-server's log.

Three sources, all synchronous and short (run them in a thread from async code):

- :class:`ScrapeSource` — GET the engine's ``/metrics`` and parse it (:mod:`specops.backends.counters`); gives
  running totals, to be windowed by :mod:`specops.watch.window`.
- :class:`PromQLSource` — ask Prometheus for the increases over the window, with the profile's label
  matchers, so one Prometheus can serve many deployments; gives a :class:`~specops.watch.window.WindowStats`
  directly. Its acceptance equals ``sum(rate(accepted[w])) / sum(rate(draft_tokens[w]))`` (see
  :meth:`PromQLSource.acceptance_query`): ``increase`` is ``rate`` times the window, so the ratio is the
  same, and the increases also give the token counts the policy's ``min_draft_tokens`` needs.
- :class:`LogLineSource` — for llama-server builds without the ``llamacpp:spec_decode_*`` counters: feed
  it the engine's log lines; it adds up the per-request ``draft acceptance = …`` lines into counters that
  read exactly like a scrape.

Every failure to read (refused connection, timeout, HTTP error, text that is not an exposition, a query
Prometheus rejects) raises :class:`SourceError`: the caller warns and decides nothing. A source that
cannot be built (a label name PromQL does not allow, a window that is not a finite number of seconds)
raises :class:`SourceConfigError`, a one-line error for the CLI. URLs in messages are redacted
(:func:`specops.urls.redact_url`: no userinfo, query values or token-like path segments).
"""

from __future__ import annotations

import math
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from specops.backends.counters import (
    SOURCE_LLAMACPP_LOG,
    MetricsError,
    SpecCounters,
    normalize_prefix,
    parse_spec_counters,
    series_names,
)
from specops.errors import SpecopsError
from specops.urls import redact_text, redact_url
from specops.watch.window import NO_DATA, OK, SPEC_OFF, WindowStats

#: What a scrape asks for: the classic text format (OpenMetrics from prometheus_client ≥ 0.23 may
#: escape ':' in names; vLLM and llama-server serve the classic format anyway).
ACCEPT = "text/plain;version=0.0.4;q=1.0, application/openmetrics-text;version=1.0.0;q=0.5, */*;q=0.1"
MAX_BYTES = 32 * 1024 * 1024


class SourceError(SpecopsError):
    """The acceptance source could not be read now; says which source and why."""


class SourceConfigError(SourceError, ValueError):
    """A source that cannot be built as configured (bad label name, window that is not finite)."""


# ---------------------------------------------------------------------------------------------------
# scrape


class ScrapeSource:
    """Reads an engine's ``/metrics`` and returns its spec-decode counters (None: no such series).

    Proxies from the environment are ignored: the engine is a local process specops started.
    """

    def __init__(
        self,
        url: str,
        prefix: str,
        model_name: str | None = None,
        timeout: float = 3.0,
        headers: Mapping[str, str] | None = None,
    ):
        self.url = url
        self.shown_url = redact_url(url)  # for messages: never the userinfo or query values
        self.headers = dict(headers or {})  # e.g. the API key llama-server wants on /metrics
        self.prefix = normalize_prefix(prefix)
        self.model_name = model_name
        self.timeout = timeout
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def fetch(self) -> tuple[str, bool]:
        """The exposition text and whether it is OpenMetrics; raises SourceError."""
        req = urllib.request.Request(self.url, headers={"Accept": ACCEPT, "User-Agent": "specops", **self.headers})
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                body = resp.read(MAX_BYTES + 1)
                ctype = resp.headers.get("Content-Type", "")
        except urllib.error.HTTPError as exc:
            raise SourceError(f"{self.shown_url}: HTTP {exc.code} {redact_text(str(exc.reason))[:200]}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise SourceError(f"{self.shown_url}: {redact_text(str(reason or type(exc).__name__))[:300]}") from None
        if len(body) > MAX_BYTES:
            raise SourceError(f"{self.shown_url}: response larger than {MAX_BYTES} bytes")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise SourceError(f"{self.shown_url}: the response is not UTF-8 text") from None
        return text, ctype.lower().startswith("application/openmetrics-text")

    def read(self) -> SpecCounters | None:
        text, openmetrics = self.fetch()
        try:
            return parse_spec_counters(text, self.prefix, self.model_name, openmetrics=openmetrics)
        except MetricsError as exc:
            raise SourceError(f"{self.shown_url}: {exc}") from None

    def __repr__(self) -> str:
        return f"ScrapeSource({self.shown_url!r}, {self.prefix!r}, model_name={self.model_name!r})"


# ---------------------------------------------------------------------------------------------------
# PromQL

_LABEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def label_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a Prometheus label name (None when it can)."""
    if not isinstance(name, str) or not _LABEL_NAME.match(name):
        shown = repr(name) if not isinstance(name, str) or len(name) <= 80 else repr(name[:77] + "...")
        return (
            f"invalid Prometheus label name {shown} in monitor.labels: use letters, digits and '_', "
            f"not starting with a digit (e.g. model_name, job)"
        )
    return None


def selector(labels: Mapping[str, str]) -> str:
    """``{a="1",b="2"}`` (sorted, escaped) from label matchers; ``""`` when there are none."""
    for name in labels:
        problem = label_name_problem(name)
        if problem is not None:
            raise SourceConfigError(problem)
    if not labels:
        return ""
    return "{" + ",".join(f"{k}={_quote(str(v))}" for k, v in sorted(labels.items())) + "}"


def promql_duration(seconds: float) -> str:
    """A PromQL range: whole seconds as ``60s``, anything finer in milliseconds (``1500ms``)."""
    try:
        ok = (
            isinstance(seconds, (int, float))
            and not isinstance(seconds, bool)
            and math.isfinite(seconds)
            and seconds > 0
        )
    except OverflowError:
        ok = False
    if not ok:
        raise SourceConfigError(
            f"a PromQL range (fallback.window) must be a finite number of seconds > 0, got {seconds!r}"
        )
    ms = round(seconds * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def promql_labels(model_name_label: bool, labels: Mapping[str, str] | None, model_name: str | None) -> dict[str, str]:
    """The profile's ``monitor.labels`` plus ``model_name`` where the engine labels its series with it.

    ``model_name_label`` is the backend's capability: vLLM writes ``model_name`` on every series, so it
    defaults to the served model; llama-server writes no labels at all, so adding one would match nothing.
    An explicit ``model_name`` in ``labels`` always wins.
    """
    out = dict(labels or {})
    if model_name and model_name_label:
        out.setdefault("model_name", model_name)
    return out


class PromQLSource:
    """Acceptance over the window from Prometheus, for the series matching ``labels``.

    ``labels`` are equality matchers (``model_name``, ``job``, ``instance``, ...); ``job``/``instance`` also
    select the scrape target whose ``up`` must be 1 — right after an engine dies the increases linger for a
    window, so a target that is down gives ``no-data``, never a verdict.
    """

    def __init__(
        self,
        prometheus_url: str,
        prefix: str,
        labels: Mapping[str, str] | None = None,
        window_s: float = 60.0,
        timeout: float = 3.0,
    ):
        self.prometheus_url = prometheus_url.rstrip("/")
        self.shown_url = redact_url(self.prometheus_url)
        self.prefix = normalize_prefix(prefix)
        self.labels = dict(labels or {})
        self._range = promql_duration(window_s)  # a clean error for 0, negative, NaN or infinite windows
        self.window_s = float(window_s)
        self.timeout = timeout
        self._sel = selector(self.labels)
        target = {k: v for k, v in self.labels.items() if k in ("job", "instance")}
        self._up_sel = selector(target) if target else None
        self._client = None

    @property
    def client(self):
        if self._client is None:
            from prometheus_api_client import PrometheusConnect
            from urllib3.util.retry import Retry

            # no retries: a dead Prometheus must fail within `timeout`, not after ~6 s of back-off
            self._client = PrometheusConnect(
                url=self.prometheus_url,
                retry=Retry(total=0, connect=0, read=0, redirect=0, status=0),
                timeout=self.timeout,
            )
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _series(self, role: str) -> str:
        return series_names(self.prefix)[role] + self._sel

    def acceptance_query(self) -> str:
        """The acceptance as one PromQL expression (what to paste into a dashboard)."""
        return (
            f"sum(rate({self._series('accepted')}[{self._range}])) / "
            f"sum(rate({self._series('draft_tokens')}[{self._range}]))"
        )

    def query(self) -> str:
        """One instant query (evaluated at one instant) whose results are told apart by a ``specops`` label."""
        r = self._range
        parts = [
            ("draft_tokens", f"sum(increase({self._series('draft_tokens')}[{r}]))"),
            ("accepted", f"sum(increase({self._series('accepted')}[{r}]))"),
            ("drafts", f"sum(increase({self._series('drafts')}[{r}]))"),
            ("per_position", f"sum by (position) (increase({self._series('per_position')}[{r}]))"),
            ("resets", f"max(resets({self._series('draft_tokens')}[{r}]))"),
            ("series", f"count({self._series('draft_tokens')})"),
            ("full", f"count({self._series('draft_tokens')} offset {r})"),
        ]
        if self._up_sel is not None:
            parts.append(("up", f"min(up{self._up_sel})"))
        return " or ".join(f'label_replace({expr}, "specops", "{name}", "", "")' for name, expr in parts)

    def read(self, now: float | None = None, eval_time: float | None = None) -> WindowStats:
        """The window ending now (or at ``eval_time``, Unix seconds on Prometheus' clock).

        ``now`` (the caller's clock, e.g. monotonic) stamps the stats so they line up with the policy's
        clock; default: the evaluation timestamp Prometheus reports.
        """
        values, per_pos, at = self._parse(self._fetch(eval_time))
        end = now if now is not None else at
        common = dict(
            window_s=self.window_s,
            end=end,
            start=(end - self.window_s) if end is not None else None,
            source="promql",
            full="full" in values,
            resets=int(values.get("resets", 0)),
        )
        return self._stats(values, per_pos, common)

    def _fetch(self, eval_time: float | None) -> Any:
        """The raw answer to :meth:`query`; every failure is a :class:`SourceError` with a redacted reason."""
        import requests
        from prometheus_api_client import PrometheusApiClientException

        params = {"time": repr(float(eval_time))} if eval_time is not None else None
        try:
            return self.client.custom_query(self.query(), params=params)
        except PrometheusApiClientException as exc:
            raise SourceError(f"Prometheus {self.shown_url}: {redact_text(str(exc))[:300]}") from None
        except requests.RequestException as exc:
            raise SourceError(f"Prometheus {self.shown_url} unreachable: {type(exc).__name__}") from None
        except ValueError as exc:  # a body that is not JSON
            raise SourceError(f"Prometheus {self.shown_url}: bad answer ({redact_text(str(exc))[:200]})") from None

    def _parse(self, result: Any) -> tuple[dict[str, float], dict[int, float], float | None]:
        """The answer's values by ``specops`` label, the per-position increases, and the evaluation time."""
        values: dict[str, float] = {}
        per_pos: dict[int, float] = {}
        at = None
        try:
            for item in result:
                name = item["metric"].get("specops")
                ts, raw = item["value"]
                at = float(ts)
                value = float(raw)  # Prometheus sends numbers as strings, "NaN" included
                if math.isnan(value):
                    continue
                if name == "per_position":
                    per_pos[int(item["metric"]["position"])] = value
                elif name:
                    values[name] = value
        except (KeyError, TypeError, ValueError) as exc:
            raise SourceError(
                f"Prometheus {self.shown_url}: unexpected answer ({redact_text(repr(exc))[:200]})"
            ) from None
        return values, per_pos, at

    def _stats(self, values: dict[str, float], per_pos: dict[int, float], common: dict[str, Any]) -> WindowStats:
        """The window from the parsed values: down target, no series, idle, or an acceptance."""
        if "up" in values and values["up"] < 1:
            return WindowStats(NO_DATA, reason=f"scrape target {self._up_sel} is down (up == 0)", **common)
        if "series" not in values:
            return WindowStats(
                SPEC_OFF,
                reason=f"no {self._series('draft_tokens')} series in Prometheus: "
                "speculation off, stats disabled, or labels that match nothing",
                **common,
            )
        tokens = values.get("draft_tokens")
        if tokens is None or tokens <= 0:
            return WindowStats(
                NO_DATA,
                reason="nothing drafted in the window (idle)",
                draft_tokens=tokens,
                accepted=values.get("accepted"),
                drafts=values.get("drafts"),
                **common,
            )
        accepted = values.get("accepted", 0.0)
        drafts = values.get("drafts")
        acceptance = min(accepted / tokens, 1.0)
        mal = 1.0 + accepted / drafts if drafts else None
        positions = tuple(per_pos.get(i, 0.0) / drafts for i in range(max(per_pos) + 1)) if per_pos and drafts else ()
        return WindowStats(
            OK,
            acceptance=acceptance,
            mean_acceptance_length=mal,
            draft_tokens=tokens,
            accepted=accepted,
            drafts=drafts,
            per_position=positions,
            reason=f"{accepted:g} accepted of {tokens:g} drafted (Prometheus increase over {self._range})",
            **common,
        )

    def __repr__(self) -> str:
        return f"PromQLSource({self.shown_url!r}, {self.prefix!r}, {self.labels!r}, {self.window_s:g})"


# ---------------------------------------------------------------------------------------------------
# llama-server log lines

#: ``draft acceptance = 0.69565 (   80 accepted /   115 generated)``; older builds say ``acceptance rate``.
ACCEPTANCE_LINE = re.compile(
    r"draft acceptance(?: rate)?\s*=\s*[-+0-9.eEnaif]+\s*\(\s*(\d+)\s+accepted\s*/\s*(\d+)\s+generated\s*\)"
)


class LogLineSource:
    """Counters added up from llama-server's per-request ``draft acceptance`` log lines.

    Feed it every engine log line (it is callable, so it can be the supervisor's line callback); read it
    like a :class:`ScrapeSource`. It counts from zero (zero counters, not None, before the first finished
    request: an idle engine is "no data"); call :meth:`reset` when the engine is restarted.
    Thread-safe: lines may arrive on one thread while another reads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._accepted = 0
        self._generated = 0
        self.lines = 0

    def feed(self, line: str) -> bool:
        """Take one log line; True when it was an acceptance line."""
        m = ACCEPTANCE_LINE.search(line)
        if m is None:
            return False
        accepted, generated = int(m.group(1)), int(m.group(2))
        if accepted > generated:
            return False  # not a line this parser understands; never let it push acceptance above 1
        with self._lock:
            self._accepted += accepted
            self._generated += generated
            self.lines += 1
        return True

    __call__ = feed

    def read(self) -> SpecCounters:
        with self._lock:
            return SpecCounters(
                draft_tokens=float(self._generated), accepted=float(self._accepted), source=SOURCE_LLAMACPP_LOG
            )

    def reset(self) -> None:
        with self._lock:
            self._accepted = self._generated = 0
            self.lines = 0
