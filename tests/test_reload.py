"""Profile reload (SIGHUP / a changed file) without the engines: what the reloader decides for each kind of
edit, what it reports (event, metric, status) and that a ConfigMap-style symlink swap is seen.

The profiles are real files loaded by the real loader and resolver; only ``apply`` (the supervisor's side)
is a recording callable here. The supervisor's zero-loss reload runs with the real llama-server in
tests/test_reload_llamacpp.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from specops.commands.status import _print_reload
from specops.config.profile import Profile, load_profile
from specops.errors import SpecopsError
from specops.run.instance import EventLog
from specops.run.reload import ProfileReloader, ReloadMetrics, changed_fields, fingerprint

BASE = {
    "name": "reload-unit",
    "backend": "vllm",
    "model": {"id": "/models/target", "max_model_len": 512},
    "speculative": {"method": "ngram", "num_speculative_tokens": 4},
    "server": {"port": 18080},
    "fallback": {"chain": ["none"]},
}


def dump(path: Path, data: dict) -> None:
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def edit(data: dict, section: str, **values) -> dict:
    return {**data, section: {**data[section], **values}}


class Rig:
    """A reloader on a profile file, with a recording ``apply``, a real event log and real metrics."""

    def __init__(self, tmp_path: Path, path: Path | None = None, take: bool = True):
        self.path = path or tmp_path / "p.yaml"
        if not self.path.exists():
            dump(self.path, BASE)
        self.events_path = tmp_path / "events.jsonl"
        self.applied: list[tuple] = []
        self.said: list[str] = []
        self.status: dict = {}
        self.take = take
        self.registry = CollectorRegistry()
        loaded = load_profile(self.path)
        self.reloader = ProfileReloader(
            loaded,
            loaded,
            apply=self.apply,
            events=EventLog(self.events_path),
            say=self.said.append,
            offline=True,
            metrics=ReloadMetrics(self.registry),
            on_status=self.status.update,
            interval=0.2,
        )

    def apply(self, loaded, changes):
        if self.take:
            self.applied.append((loaded.profile, changes))
        return self.take

    def events(self, kind: str) -> list[dict]:
        if not self.events_path.exists():
            return []
        evs = [json.loads(line) for line in self.events_path.read_text().splitlines() if line.strip()]
        return [e for e in evs if e["event"] == kind]

    def metric(self, name: str) -> float:
        for line in generate_latest(self.registry).decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                if line.split(" ")[0] == name or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not exposed")


def test_unchanged_file_does_nothing(tmp_path):
    rig = Rig(tmp_path)
    assert rig.reloader.check() is None
    out = rig.reloader.check(forced=True)  # SIGHUP on the running content
    assert out is not None and out.result == "unchanged"
    assert rig.applied == []
    assert rig.metric('specops_profile_reload_total{result="unchanged"}') == 1


def test_comment_only_edit_is_unchanged_without_a_restart(tmp_path):
    rig = Rig(tmp_path)
    rig.path.write_text("# a comment\n" + rig.path.read_text())
    out = rig.reloader.check()
    assert out is not None and out.result == "unchanged"
    assert rig.applied == []
    assert rig.reloader.check() is None  # the new bytes are now the running ones


def test_valid_edit_is_applied_with_its_changes(tmp_path):
    rig = Rig(tmp_path)
    dump(rig.path, edit(BASE, "speculative", num_speculative_tokens=2))
    out = rig.reloader.check()
    assert out is not None and out.result == "applied", out
    ((profile, changes),) = rig.applied
    assert profile.speculative.k == 2
    assert changes == ["speculative.num_speculative_tokens"]
    assert rig.events("reload")[0]["changes"] == changes
    assert rig.metric('specops_profile_reload_total{result="applied"}') == 1
    assert rig.status["applied"] == 1 and rig.status["rejected"] is None
    assert rig.reloader.check() is None  # applied once


def test_busy_supervisor_is_asked_again_at_the_next_poll(tmp_path):
    rig = Rig(tmp_path, take=False)
    dump(rig.path, edit(BASE, "speculative", num_speculative_tokens=3))
    assert rig.reloader.check().result == "pending"
    rig.take = True
    assert rig.reloader.check().result == "applied"


def test_invalid_field_is_rejected_with_its_location_and_shown(tmp_path, capsys):
    rig = Rig(tmp_path)
    bad = edit(BASE, "speculative", num_speculative_tokens=-3)
    dump(rig.path, bad)
    assert rig.reloader.check().result == "pending"  # perhaps half-written: one more poll
    out = rig.reloader.check()
    assert out is not None and out.result == "rejected"
    line = next(i for i, text in enumerate(rig.path.read_text().splitlines(), 1) if "num_speculative_tokens" in text)
    assert f"{rig.path}:{line}:" in out.message and "speculative.num_speculative_tokens" in out.message
    ev = rig.events("reload-rejected")[0]
    assert ev["problems"][0]["line"] == line and ev["problems"][0]["field"] == "speculative.num_speculative_tokens"
    assert rig.applied == []
    assert rig.metric('specops_profile_reload_total{result="rejected"}') == 1
    assert rig.metric("specops_profile_reload_failed") == 1
    assert rig.reloader.check() is None  # reported once per content
    assert len(rig.events("reload-rejected")) == 1
    _print_reload(rig.status)
    shown = capsys.readouterr().out
    assert "profile reload rejected, keeps running the old config" in shown and f"{rig.path}:{line}:" in shown
    # back to the running content: the rejection clears
    dump(rig.path, BASE)
    assert rig.reloader.check() is None
    assert rig.status["rejected"] is None and rig.metric("specops_profile_reload_failed") == 0


def test_broken_yaml_on_sighup_is_reported_at_once(tmp_path):
    rig = Rig(tmp_path)
    rig.path.write_text(rig.path.read_text() + "speculative: [unclosed\n")
    out = rig.reloader.check(forced=True)
    assert out is not None and out.result == "rejected"
    assert f"{rig.path}:" in out.message
    assert rig.applied == []


@pytest.mark.parametrize(
    ("section", "values", "field"),
    [
        ("server", {"port": 18081}, "server.port"),
        ("proxy", {"queue_size": 3}, "proxy"),
        ("supervisor", {"state_dir": "/tmp/elsewhere"}, "supervisor.state_dir"),
        ("deploy", {"max_switching": 2}, "deploy.max_switching"),
        ("certify", {"spot_check": {"every": "20m"}}, "certify"),
    ],
)
def test_fields_that_need_a_restart_are_rejected_saying_so(tmp_path, section, values, field):
    rig = Rig(tmp_path)
    data = {**BASE, section: {**BASE.get(section, {}), **values}}
    dump(rig.path, data)
    out = rig.reloader.check(forced=True)
    assert out is not None and out.result == "rejected"
    assert f"{field} changed" in out.message and "keeps running the old config until it is restarted" in out.message
    assert out.problems[0].location is not None and out.problems[0].location.file == str(rig.path)
    assert rig.applied == []


def test_renamed_instance_needs_a_restart(tmp_path):
    rig = Rig(tmp_path)
    dump(rig.path, {**BASE, "name": "other"})
    out = rig.reloader.check(forced=True)
    assert out.result == "rejected" and "name changed" in out.message


def test_apply_refusal_is_a_rejection(tmp_path):
    rig = Rig(tmp_path)

    def refuse(loaded, changes):
        raise SpecopsError("cannot render draft_model: the draft file is missing")

    rig.reloader.apply = refuse
    dump(rig.path, edit(BASE, "speculative", num_speculative_tokens=5))
    out = rig.reloader.check(forced=True)
    assert out.result == "rejected" and "draft file is missing" in out.message
    assert rig.reloader.snapshot()["rejected"]["message"] == out.message


def configmap(root: Path, version: str, data: dict) -> None:
    """The layout kubelet writes for a ConfigMap volume: ``p.yaml -> ..data/p.yaml``, ``..data -> ..<version>``;
    an update writes a new version folder and swaps ``..data`` atomically (rename of a new symlink)."""
    folder = root / f"..{version}"
    folder.mkdir()
    dump(folder / "p.yaml", data)
    tmp = root / "..data_tmp"
    os.symlink(folder.name, tmp)
    os.replace(tmp, root / "..data")
    if not (root / "p.yaml").is_symlink():
        os.symlink("..data/p.yaml", root / "p.yaml")


def test_configmap_symlink_swap_is_seen_by_the_poll(tmp_path):
    mount = tmp_path / "mount"
    mount.mkdir()
    configmap(mount, "v1", BASE)
    rig = Rig(tmp_path, path=mount / "p.yaml")
    before = fingerprint(rig.reloader.files)
    configmap(mount, "v2", edit(BASE, "speculative", num_speculative_tokens=6))
    assert fingerprint(rig.reloader.files) != before

    async def main():
        rig.reloader.start()
        for _ in range(50):
            if rig.applied:
                break
            await asyncio.sleep(0.1)
        await rig.reloader.stop()

    asyncio.run(main())
    assert len(rig.applied) == 1 and rig.applied[0][0].speculative.k == 6


def test_sighup_trigger_wakes_the_loop_at_once(tmp_path):
    rig = Rig(tmp_path)
    rig.reloader.interval = 3600  # only the trigger can wake it

    async def main():
        rig.reloader.start()
        await asyncio.sleep(0.05)
        dump(rig.path, edit(BASE, "speculative", num_speculative_tokens=7))
        rig.reloader.trigger()
        for _ in range(50):
            if rig.applied:
                break
            await asyncio.sleep(0.05)
        await rig.reloader.stop()

    asyncio.run(main())
    assert len(rig.applied) == 1


def test_changed_fields_never_shows_values():
    assert changed_fields(
        {"server": {"api_key": "s3cret", "port": 1}}, {"server": {"api_key": "other", "port": 1}}
    ) == ["server.api_key"]


def test_supervisor_reload_restarts_on_the_new_profiles_primary_step():
    """The supervisor's side, on the stand-in engine: refused unless serving, then hold → drain → stop → start
    the new profile's step 0 → ready, with the old chain's pending switch dropped."""
    from support_ports import free_port
    from support_supervisor import (
        STANDIN,
        ScriptedDecider,
        make_profile,
        standin,
        supervisor,
        wait_until,
    )

    from specops.run.events import EngineReady
    from specops.run.supervise import ReloadOrder

    port = free_port()
    log = EventLog(None)
    data = make_profile(restart_backoff=0.1).model_dump(mode="json", exclude_defaults=True)
    new = Profile.model_validate({**data, "fallback": {"chain": ["none"]}})

    def render_new(i):
        return standin(i, port, argv=[sys.executable, str(STANDIN), "--port", str(port), "--name", "reloaded"])

    order = ReloadOrder(new, render_new, "the profile file changed", ("fallback.chain",))

    async def main():
        sup, rec = supervisor(lambda i: standin(i, port), ScriptedDecider(), events=log)
        assert not sup.request_reload(order)  # not serving yet
        task = asyncio.create_task(sup.run())
        await wait_until(lambda: rec.of(EngineReady), what="ready")
        from specops.run.events import SwitchOrder

        assert sup.request_switch(SwitchOrder(1, "low acceptance"))
        assert sup.request_reload(order)
        assert not sup.request_reload(order) and not sup.request_switch(SwitchOrder(2, "another"))
        await wait_until(lambda: len(rec.of(EngineReady)) == 2, what="ready after the reload")
        sup.request_stop()
        await task
        return sup, rec

    sup, rec = asyncio.run(asyncio.wait_for(main(), 60))
    second = rec.of(EngineReady)[1]
    assert second.index == 0 and "reloaded" in second.plan.argv
    assert [s.method.value for s in sup.steps] == ["draft_model", "none"] and sup.profile is new
    assert sup.backoff == 0.1
    [switch] = [e for e in log.recent if e["event"] == "reload-switch"]
    assert switch["changes"] == ["fallback.chain"] and switch["to"] == "draft_model"
    assert [e for e in log.recent if e["event"] == "switch-complete"]
    assert not [e for e in log.recent if e["event"] == "switch"]  # the old chain's switch was dropped


def test_a_reloaded_profile_that_does_not_start_gives_way_to_the_previous_one():
    """The new primary step exits at once: the supervisor runs the old profile again, at the step it was on,
    says so (``reload-failed``) and calls the order's ``on_failed``."""
    from support_ports import free_port
    from support_supervisor import (
        ScriptedDecider,
        exits_at_once,
        make_profile,
        standin,
        supervisor,
        wait_until,
    )

    from specops.run.events import EngineReady
    from specops.run.supervise import ReloadOrder

    port = free_port()
    log = EventLog(None)
    old = make_profile()
    data = old.model_dump(mode="json", exclude_defaults=True)
    new = Profile.model_validate({**data, "fallback": {"chain": ["none"]}})
    told: list[str] = []
    order = ReloadOrder(new, lambda i: standin(i, port, argv=exits_at_once()), "edit", on_failed=told.append)

    async def main():
        sup, rec = supervisor(lambda i: standin(i, port), ScriptedDecider(), profile=old, events=log)
        task = asyncio.create_task(sup.run())
        await wait_until(lambda: rec.of(EngineReady), what="ready")
        assert sup.request_reload(order)
        await wait_until(lambda: len(rec.of(EngineReady)) == 2, what="the old profile ready again")
        sup.request_stop()
        await task
        return sup, rec

    sup, rec = asyncio.run(asyncio.wait_for(main(), 60))
    assert sup.profile is old and [s.method.value for s in sup.steps] == ["draft_model", "ngram", "none"]
    assert rec.of(EngineReady)[1].index == 0 and "step0" in rec.of(EngineReady)[1].plan.argv
    [failed] = [e for e in log.recent if e["event"] == "reload-failed"]
    assert failed["back_to"] == "draft_model" and "exit" in failed["reason"]
    assert len(told) == 1 and told[0] == failed["reason"]


def test_rolled_back_reload_is_reported_as_rejected_once(tmp_path):
    rig = Rig(tmp_path)
    first_sha = rig.reloader.running_sha
    dump(rig.path, edit(BASE, "speculative", num_speculative_tokens=2))
    assert rig.reloader.check().result == "applied"
    rig.reloader.rolled_back("engine exited with code 3 before it was ready")
    assert rig.reloader.running_sha == first_sha and rig.reloader.running.profile.speculative.k == 4
    assert "did not start (engine exited with code 3" in rig.status["rejected"]["message"]
    assert rig.metric("specops_profile_reload_failed") == 1
    assert rig.reloader.check() is None  # the same file is not tried again
    dump(rig.path, BASE)
    assert rig.reloader.check() is None and rig.status["rejected"] is None


def test_loading_and_resolving_run_off_the_event_loop(tmp_path):
    """The proxy shares the event loop: reading, validating and resolving (which may ask the Hub) run in a
    thread, applying on the loop."""
    import threading

    rig = Rig(tmp_path)
    seen: dict[str, int] = {}
    rig.reloader._load = lambda path: seen.setdefault("load", threading.get_ident()) and load_profile(path)
    apply = rig.apply
    rig.reloader.apply = lambda loaded, changes: (
        seen.setdefault("apply", threading.get_ident()) and apply(loaded, changes)
    )
    dump(rig.path, edit(BASE, "speculative", num_speculative_tokens=2))
    out = asyncio.run(rig.reloader.check_async(forced=True))
    assert out is not None and out.result == "applied"
    assert seen["apply"] == threading.get_ident() != seen["load"]
