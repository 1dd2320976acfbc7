"""`specops status` of an instance whose proxy wants an API key (server.api_key) on its public port: the
live section is fetched with the key when status is given the profile file, and the row says how to get
it when status only has the name. The key never appears in the output."""

from __future__ import annotations

import json
import subprocess

import pytest
from support_ports import free_port
from support_up import SPECOPS, UpRun, write_profile

pytestmark = [pytest.mark.engines, pytest.mark.timeout(300)]
KEY = "sk-status-test-4f1d9c"


def test_status_fetches_the_live_section_with_the_profiles_key(tmp_path, tiny_gguf_models):
    profile = write_profile(
        tmp_path / "keyed.yaml",
        {
            "name": "keyed",
            "backend": "llamacpp",
            "model": {"id": str(tiny_gguf_models / "gguf-target.gguf"), "max_model_len": 512},
            "speculative": {"method": "ngram"},
            "gpus": {"devices": []},
            "server": {"port": free_port(), "api_key": "${STATUS_TEST_KEY}"},
        },
    )
    env = {"STATUS_TEST_KEY": KEY}
    with UpRun(profile, tmp_path / "state", "keyed", env=env) as run:
        run.wait_ready(timeout=60)

        def status(*args: str) -> subprocess.CompletedProcess:
            out = subprocess.run(SPECOPS + ["status", *args], capture_output=True, text=True, env=run.env, timeout=30)
            assert out.returncode == 0, out.stderr
            assert KEY not in out.stdout + out.stderr
            return out

        by_name = json.loads(status("keyed", "--json").stdout)
        assert "live" not in by_name and "API key" in by_name["live_problem"]
        assert "live       the proxy wants the API key" in status("keyed").stdout
        by_file = json.loads(status(str(profile), "--json").stdout)
        assert "live_problem" not in by_file and by_file["live"]["proxy"]["state"] == "serving"
        assert run.stop() == 0
