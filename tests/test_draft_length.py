"""The draft length the engine really uses, as each backend says of a rendered plan (never a k it ignores):
llama-server's n-gram drafters size their drafts with their own flags (ngram-mod: up to 64 by default),
draft models take ``--spec-draft-n-max``; vLLM drafts ``num_speculative_tokens``; a plugin gets the
default through the same API. ``specops status`` and ``specops up`` print it, with the mean measured."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml
from support_cli import ROOT, run
from support_up import SPECOPS, UpRun, llama_profile

from specops.backends.base import EngineInfo
from specops.backends.render import render_plan
from specops.config.profile import Profile, load_profile
from specops.plugins import get_registry
from specops.run.instance import InstancePaths, write_state

EXAMPLE = ROOT / "plugins" / "specops-example-backend"


def plan_of(tmp_path, profile: dict, version: str):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(profile), encoding="utf-8")
    return render_plan(load_profile(path), get_registry(), backend_version=version, probe=False)


def llama(spec: dict, extra_args: list[str] | None = None) -> dict:
    return {
        "name": "p",
        "backend": "llamacpp",
        "model": {"id": "/models/t.gguf"},
        "speculative": spec,
        "gpus": {"devices": []},
        "server": {"extra_args": extra_args or []},
    }


def vllm(spec: dict) -> dict:
    return {"name": "p", "backend": "vllm", "model": {"id": "org/target"}, "speculative": spec}


def test_ngram_mod_drafts_up_to_llama_servers_default_not_the_profiles_k(tmp_path):
    plan = plan_of(tmp_path, llama({"method": "ngram", "ngram": {"type": "ngram-mod"}}), "b9300")
    assert "--spec-draft-n-max" not in plan.argv  # nothing renders a k for it ...
    d = plan.draft_length
    assert (d.most, d.exact) == (64, False)  # ... and the report does not invent one
    assert d.describe() == "up to 64 (ngram-mod --spec-ngram-mod-n-max, llama-server default)"
    # the default n-gram drafter of current builds is ngram-mod too
    assert plan_of(tmp_path, llama({"method": "ngram"}), "current").draft_length.most == 64


@pytest.mark.parametrize(
    ("ngram_type", "flag", "most"),
    [("ngram-simple", "--spec-ngram-simple-size-m", 48), ("ngram-map-k4v", "--spec-ngram-map-k4v-size-m", 48)],
)
def test_other_ngram_drafters_have_their_own_size_flag(tmp_path, ngram_type, flag, most):
    d = plan_of(tmp_path, llama({"method": "ngram", "ngram": {"type": ngram_type}}), "current").draft_length
    assert (d.most, d.source) == (most, f"{ngram_type} {flag}, llama-server default")


@pytest.mark.parametrize("args", [["--spec-ngram-mod-n-max", "24"], ["--spec-ngram-mod-n-max=24"]])
def test_extra_args_that_size_the_drafts_win(tmp_path, args):
    d = plan_of(tmp_path, llama({"method": "ngram"}, args), "current").draft_length
    assert d.describe() == "up to 24 (--spec-ngram-mod-n-max 24 in server.extra_args)"


def test_an_older_build_whose_defaults_were_not_read_says_the_engine_decides(tmp_path):
    d = plan_of(tmp_path, llama({"method": "ngram", "ngram": {"type": "ngram-simple"}}), "b7700").draft_length
    assert d.most is None and d.text == "set by the engine" and "spec-type flags" in d.source


def test_a_llama_draft_model_drafts_up_to_spec_draft_n_max(tmp_path):
    spec = {"method": "draft_model", "draft": "/models/d.gguf", "num_speculative_tokens": 6}
    assert plan_of(tmp_path, llama(spec), "current").draft_length.describe() == (
        "up to 6 (--spec-draft-n-max from speculative.num_speculative_tokens)"
    )
    legacy = plan_of(tmp_path, llama({"method": "draft_model", "draft": "/models/d.gguf"}), "legacy").draft_length
    assert legacy.describe() == "up to 4 (--draft-max from specops' default k for draft_model)"
    assert plan_of(tmp_path, llama({"method": "none"}), "current").draft_length is None


def test_vllm_drafts_num_speculative_tokens(tmp_path):
    draft = plan_of(tmp_path, vllm({"method": "draft_model", "draft": "org/d", "num_speculative_tokens": 3}), "0.32.0")
    assert draft.draft_length.describe() == "3 (speculative.num_speculative_tokens)" and draft.draft_length.exact
    ngram = plan_of(tmp_path, vllm({"method": "ngram", "num_speculative_tokens": 5}), "0.32.0").draft_length
    assert ngram.describe() == "up to 5 (speculative.num_speculative_tokens, ngram lookup)"
    sched = {"method": "draft_model", "draft": "org/d", "num_speculative_tokens": 2, "per_batch_size": [[1, 4, 6]]}
    d = plan_of(tmp_path, vllm(sched), "0.32.0").draft_length
    assert (d.most, d.exact) == (6, False) and "per_batch_size by batch size 1-4: 6, else 2" in d.source


def test_a_plugin_backend_gets_the_default_through_the_same_api(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from specops_example_backend import SglangBackend

    data = yaml.safe_load((EXAMPLE / "example-profile.yaml").read_text(encoding="utf-8"))
    profile = Profile.model_validate({**data, "server": {"port": 30000}})
    backend = SglangBackend()
    plan = backend.render(profile, EngineInfo("sglang", "0.5.4", "pinned", ("python3", "-m", "sglang.launch_server")))
    assert plan.draft_length.describe() == "up to 3 (speculative.num_speculative_tokens)"


def test_status_shows_the_draft_length_and_the_measured_mean(tmp_path):
    plan = plan_of(tmp_path, llama({"method": "ngram"}), "current")
    acceptance = {"status": "ok", "window_s": 60, "acceptance": 0.6, "mean_acceptance_length": 13.0,
                  "draft_tokens": 420.0, "accepted": 252.0, "drafts": 20.0}  # fmt: skip
    write_state(
        InstancePaths(tmp_path / "s" / "n"),
        {"name": "n", "state": "ready", "method": "ngram", "draft_length": plan.draft_length.to_dict(),
         "acceptance": acceptance},
    )  # fmt: skip
    res = run("status", "n", "--state-dir", tmp_path / "s")
    assert res.code == 0, res.stderr
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("  drafts"))
    assert line == (
        "  drafts     up to 64 (ngram-mod --spec-ngram-mod-n-max, llama-server default); "
        "measured mean 21.0 tokens per draft over 60s"
    )
    assert "k=" not in res.stdout


# ------------------------------------------------------------------------------------ real engines


@pytest.mark.engines
def test_the_defaults_specops_states_are_the_built_llama_servers():
    from support_engines import need_llama_server

    from specops.backends.llamacpp import NGRAM_DRAFT_SIZE

    helptext = subprocess.run([need_llama_server(), "--help"], capture_output=True, text=True, timeout=60).stdout
    for flag, default in NGRAM_DRAFT_SIZE.values():
        if flag is not None:
            m = re.search(rf"^{re.escape(flag)} N\s+.*?\(default: (\d+)\)", helptext, re.M | re.S)
            assert m and int(m.group(1)) == default, flag


@pytest.mark.engines
@pytest.mark.timeout(180)
def test_up_and_status_show_ngram_mods_draft_length(tmp_path, tiny_gguf_models):
    profile = llama_profile(tmp_path, tiny_gguf_models, "ngramlen", method="ngram")
    with UpRun(profile, tmp_path / "state", "ngramlen") as up:
        st = up.wait_ready(120)
        assert st["draft_length"]["most"] == 64
        ready = up.wait_line("ready in")
        assert "draft length up to 64 (ngram-mod --spec-ngram-mod-n-max, llama-server default)" in ready
        assert "k=" not in ready
        out = subprocess.run(SPECOPS + ["status", "ngramlen"], capture_output=True, text=True, env=up.env, timeout=30)
        assert "  drafts     up to 64 (ngram-mod" in out.stdout, out.stdout + out.stderr
        assert up.status_json()["draft_length"]["source"].startswith("ngram-mod")
