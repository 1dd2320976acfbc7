"""The real engines for the race: :mod:`specops.perf.launch` starts them, :mod:`specops.perf.workload`
measures them."""

from __future__ import annotations

import contextlib
from pathlib import Path

from specops.errors import SpecopsError
from specops.perf.tune.results import Round
from specops.perf.tune.settings import Setting


def load_workload(spec: str | None, max_tokens: int | None = None):
    """Prompts for the rounds: built-in set names and/or JSONL files, comma-separated, interleaved so the
    first prompts of a round cover every set. Default: every built-in set. Returns (prompts, description)."""
    from specops.perf.workload import BUILTIN_SETS, Prompt, load_prompts

    names = [x.strip() for x in (spec or ",".join(BUILTIN_SETS)).split(",") if x.strip()]
    if not names:
        raise SpecopsError("--workload: no prompt set given")
    sets = [load_prompts(n) for n in names]
    prompts = []
    for i in range(max(len(s) for s in sets)):
        prompts += [s[i] for s in sets if i < len(s)]
    if max_tokens is not None:
        prompts = [Prompt(p.text, min(p.max_tokens, max_tokens), p.temperature, p.set) for p in prompts]
    return prompts, {"sets": names, "prompts": len(prompts), "max_tokens": max_tokens}


def default_requests_per_round(concurrency: int) -> int:
    """Enough requests that every client is busy twice, and at least 4 (one of each built-in set)."""
    return max(4, 2 * concurrency)


class EngineDriver:
    """Launches ``setting.apply(resolved)`` with :func:`specops.perf.launch.launched` for each setting."""

    def __init__(
        self,
        loaded,
        resolved,
        registry,
        engine,
        prompts,
        *,
        requests_per_round=default_requests_per_round,
        offline: bool = False,
        log_path: Path | None = None,
        ready_timeout: float | None = None,
        extra_body: dict | None = None,
        workload: dict | None = None,
    ):
        self.loaded, self.resolved, self.registry, self.engine = loaded, resolved, registry, engine
        #: the workload's description (the record's ``workload``); gets ``fitted`` when prompts were trimmed
        self.workload = workload
        self.fitted = False
        self.extra_body = extra_body
        self.prompts = list(prompts)
        self.requests_per_round = requests_per_round
        self.offline = offline
        self.log_path = log_path
        self.ready_timeout = ready_timeout
        self.launch_prior_s = registry.backend(resolved.backend).launch_prior_s

    def round_prompts(self, concurrency: int) -> list:
        n = self.requests_per_round(concurrency)
        return [self.prompts[i % len(self.prompts)] for i in range(n)]

    @contextlib.asynccontextmanager
    async def session(self, setting: Setting):
        from specops.perf.launch import launched

        async with launched(
            self.loaded,
            self.registry,
            profile=setting.apply(self.resolved),
            engine=self.engine,
            offline=self.offline,
            log_path=self.log_path,
            ready_timeout=self.ready_timeout,
        ) as eng:
            if not self.fitted:
                await self.fit(eng)
            yield _EngineSession(eng, self)

    async def fit(self, eng) -> None:
        """Fit the prompts to the context one request gets on the first engine (its tokenizer counts), once:
        every setting then sees the same prompts."""
        from specops.perf.workload import fit_workload

        fit = await fit_workload([eng], {"tune": self.prompts}, fallback_context=self.resolved.model.max_model_len)
        self.prompts, self.fitted = fit.sets["tune"], True
        if fit.notes and self.workload is not None:
            self.workload["fitted"] = {"context_per_request": fit.context, "counted_by": fit.counted_by}
            self.workload.setdefault("notes", []).extend(fit.notes)


class _EngineSession:
    def __init__(self, eng, driver: EngineDriver):
        self.eng, self.driver = eng, driver

    async def warmup(self, concurrency: int) -> None:
        from specops.perf.workload import warm_up

        # the round's own prompts, so caches are primed alike for every setting
        await warm_up(
            self.eng, self.driver.round_prompts(concurrency), concurrency=concurrency, extra_body=self.driver.extra_body
        )

    async def run(self, concurrency: int) -> Round:
        from specops.perf.workload import run_workload

        prompts = self.driver.round_prompts(concurrency)
        res = await run_workload(
            self.eng.base_url,
            self.eng.model_name,
            prompts,
            concurrency=concurrency,
            requests=len(prompts),
            api_key=self.eng.api_key,
            extra_body=self.driver.extra_body,
        )
        if not self.eng.process.running:
            raise SpecopsError(f"the engine {self.eng.process.exit.describe()} during a round")
        ms = lambda v: None if v is None else v * 1000  # noqa: E731
        return Round(
            tokens_per_s=res.tokens_per_s,
            output_tokens=res.output_tokens,
            requests=len(res.requests),
            errors=len(res.errors),
            wall_s=res.wall_s,
            ttft_ms=ms(res.ttft_median),
            tpot_ms=ms(res.tpot_median),
            first_error=next((r.error for r in res.errors), None),
            draft_tokens=res.draft_tokens,
            accepted=res.accepted,
        )

    async def counters(self):
        try:
            return await self.eng.counters()
        except SpecopsError:
            return None

    async def acceptance_since(self, before):
        try:
            return await self.eng.acceptance_since(before)
        except SpecopsError:
            return None
