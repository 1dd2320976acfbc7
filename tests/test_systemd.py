"""`specops systemd`: the unit's contract (absolute ExecStart, KillMode, TimeoutStopSec over the stop budget,
Restart, secrets only by name), checked by parsing the unit and by `systemd-analyze verify`."""

from __future__ import annotations

import os
import pwd
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import unavailable
from support_cli import ROOT, ready_made_profiles, run
from support_procs import stop_group

from specops.config.durations import parse_duration

CPU_PROFILE = ROOT / "examples" / "llamacpp-cpu-draft.yaml"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (a key may repeat), as systemd reads a unit (comments skipped)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for line in text.splitlines():
        if not line.strip() or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            assert section not in out, f"section {section} twice"
            out[section] = {}
            continue
        assert section is not None, f"{line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        out[section].setdefault(key, []).append(value)
    return out


def exec_words(value: str) -> list[str]:
    """ExecStart's words: systemd's double quotes and backslash escapes, then %% and $$ unescaped."""
    return [w.replace("%%", "%").replace("$$", "$") for w in shlex.split(value)]


def one(unit, section, key) -> str:
    values = unit[section].get(key)
    assert values is not None and len(values) == 1, f"{section}.{key}: {values}"
    return values[0]


def write_profile(folder: Path, name: str, extra: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(
        f"name: {name}\nbackend: llamacpp\nmodel: {{id: /models/target.gguf}}\n"
        "speculative: {method: ngram}\ngpus: {devices: []}\n" + extra,
        encoding="utf-8",
    )
    return path


def systemd_analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        unavailable("systemd-analyze is not installed (the systemd package)")
    return exe


def verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [systemd_analyze(), "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=60
    )


# ---------------------------------------------------------------------------------------- the contract


def test_system_unit_runs_specops_up_with_absolute_paths(tmp_path):
    res = run("systemd", "examples/llamacpp-cpu-draft.yaml")
    assert res.code == 0, res.stderr
    unit = parse_unit(res.stdout)
    words = exec_words(one(unit, "Service", "ExecStart"))
    assert len(words) == 3 and words[1] == "up"
    exe, profile = Path(words[0]), Path(words[2])
    assert exe.is_absolute() and profile.is_absolute()
    assert profile == CPU_PROFILE
    assert os.access(exe, os.X_OK)
    # the program and profile it names really work: the same argv with `validate` in place of `up`
    check = subprocess.run([str(exe), "validate", str(profile)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    svc = unit["Service"]
    assert one(unit, "Service", "KillMode") == "mixed"
    assert one(unit, "Service", "Restart") == "on-failure"
    assert one(unit, "Service", "Type") == "exec"
    assert one(unit, "Service", "User") == pwd.getpwuid(os.getuid()).pw_name
    assert one(unit, "Service", "ExecReload") == "/bin/kill -HUP $MAINPID"  # `specops up` reloads on SIGHUP
    # the proxy raises its own soft open-files limit up to the hard one; a LimitNOFILE would cap that
    assert "LimitNOFILE" not in svc
    assert one(unit, "Service", "EnvironmentFile") == "-/etc/specops/llamacpp-cpu-draft.env"
    assert one(unit, "Install", "WantedBy") == "multi-user.target"
    # defaults: drain 60 s, stop 30 s: the stop budget is at least drain + SIGTERM→SIGKILL + the group's wait
    timeout = int(one(unit, "Service", "TimeoutStopSec"))
    assert timeout >= 60 + 30 + 30 + 5
    assert "drain 60s" in res.stdout and "= 135s" in res.stdout


@pytest.mark.parametrize(
    ("settings", "at_least"),
    [
        ("proxy: {drain_timeout: 5m}\nsupervisor: {stop_timeout: 2m}\n", 300 + 120 + 120),
        ("proxy: {enabled: false}\nsupervisor: {stop_timeout: 45s}\n", 45 + 45),
        ("monitor: {timeout: 20s}\nproxy: {drain_timeout: 1s}\nsupervisor: {stop_timeout: 1s}\n", 20 + 1 + 1 + 1),
    ],
)
def test_timeout_stop_sec_covers_the_profiles_stop_budget(tmp_path, settings, at_least):
    import yaml

    path = write_profile(tmp_path, "budget", settings)
    res = run("systemd", path)
    assert res.code == 0, res.stderr
    timeout = int(one(parse_unit(res.stdout), "Service", "TimeoutStopSec"))
    data = yaml.safe_load(settings)
    drain = parse_duration(str(data.get("proxy", {}).get("drain_timeout", "60s")))
    stop = parse_duration(str(data.get("supervisor", {}).get("stop_timeout", "30s")))
    proxied = data.get("proxy", {}).get("enabled", True)
    assert timeout > (drain if proxied else 0) + 2 * stop
    assert timeout >= at_least


def test_secrets_stay_out_of_the_unit_and_are_named_for_the_environment_file(tmp_path):
    key, token = "sk-live-0123456789abcdef", "hf_SECRETtoken987654321"
    path = write_profile(
        tmp_path,
        "secret",
        "server: {api_key: '${SPECOPS_T_API_KEY}', env: {HF_TOKEN: '${SPECOPS_T_HF}'}}\n",
    )
    res = run("systemd", path, env={"SPECOPS_T_API_KEY": key, "SPECOPS_T_HF": token})
    assert res.code == 0, res.stderr
    for value in (key, token, "sk-live", "hf_SECRET"):
        assert value not in res.stdout and value not in res.stderr
    unit = parse_unit(res.stdout)
    # the profile needs the variables: the file is required (no leading '-'), and the unit names them
    assert one(unit, "Service", "EnvironmentFile") == "/etc/specops/secret.env"
    assert "SPECOPS_T_API_KEY, SPECOPS_T_HF" in res.stdout
    assert "Environment" not in unit["Service"]  # nothing set inline


def test_a_unit_that_would_hold_a_secret_value_is_refused(tmp_path):
    secret = "tok-abcdef-987654"
    path = write_profile(tmp_path / secret, "leaky", "server: {api_key: '${SPECOPS_T_API_KEY}'}\n")
    res = run("systemd", path, env={"SPECOPS_T_API_KEY": secret})
    assert res.code == 1
    assert "SPECOPS_T_API_KEY" in res.stderr and "refusing" in res.stderr
    assert res.stdout == ""
    # the refusal names the variable, never the value (the path holds it, so no path is printed either)
    assert secret not in res.stderr


@pytest.mark.parametrize(
    ("model", "spec"),
    [("./models/target.gguf", "{method: ngram}"), ("/models/target.gguf", "{method: draft_model, draft: d.gguf}")],
)
def test_relative_model_paths_are_refused(tmp_path, model, spec):
    """The service runs in /, where a path relative to the shell's folder finds nothing."""
    path = tmp_path / "relative.yaml"
    path.write_text(
        f"name: relative\nbackend: llamacpp\nmodel: {{id: {model}}}\nspeculative: {spec}\ngpus: {{devices: []}}\n",
        encoding="utf-8",
    )
    res = run("systemd", path)
    assert res.code == 1 and "relative path" in res.stderr and "runs in /" in res.stderr
    assert res.stdout == ""


def test_a_missing_variable_is_the_profiles_located_error(tmp_path):
    path = write_profile(tmp_path, "unset", "server: {api_key: '${SPECOPS_T_UNSET_KEY}'}\n")
    res = run("systemd", path, env={"SPECOPS_T_UNSET_KEY": None})
    assert res.code == 1 and "SPECOPS_T_UNSET_KEY" in res.stderr and "is not set" in res.stderr
    assert res.stdout == ""


def test_user_unit(tmp_path):
    res = run("systemd", "examples/llamacpp-cpu-draft.yaml", "--user")
    assert res.code == 0, res.stderr
    unit = parse_unit(res.stdout)
    assert "User" not in unit["Service"]
    assert one(unit, "Install", "WantedBy") == "default.target"
    assert one(unit, "Service", "EnvironmentFile") == "-%h/.config/specops/llamacpp-cpu-draft.env"
    assert "network-online.target" not in res.stdout  # no such target in a user manager
    assert "enable-linger" in res.stdout
    assert run("systemd", "examples/llamacpp-cpu-draft.yaml", "--user", "--run-as", "bob").code == 2


def test_output_is_deterministic_and_written_whole(tmp_path):
    first = run("systemd", "examples/llamacpp-cpu-draft.yaml", "--run-as", "specops")
    second = run("systemd", "examples/llamacpp-cpu-draft.yaml", "--run-as", "specops")
    assert first.code == 0 and first.stdout == second.stdout
    assert "User=specops" in first.stdout
    out = tmp_path / "specops-llamacpp-cpu-draft.service"
    res = run("systemd", "examples/llamacpp-cpu-draft.yaml", "--run-as", "specops", "-o", out)
    assert res.code == 0, res.stderr
    assert out.read_text(encoding="utf-8") == first.stdout
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert "daemon-reload" in res.stderr and "enable --now specops-llamacpp-cpu-draft.service" in res.stderr
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temporary file left


@pytest.mark.parametrize("bad", ["root;rm", "a b", "-x", ""])
def test_run_as_must_be_a_user_name(bad):
    res = run("systemd", "examples/llamacpp-cpu-draft.yaml", "--run-as", bad)
    assert res.code == 2 and "--run-as" in res.stderr


@pytest.mark.parametrize("bad", ["relative.env", "/etc/specops/a b.env", "/etc/%n.env"])
def test_env_file_must_be_a_plain_absolute_path(bad):
    res = run("systemd", "examples/llamacpp-cpu-draft.yaml", "--env-file", bad)
    assert res.code == 1 and "--env-file" in res.stderr


# ---------------------------------------------------------------------------------------- systemd reads it


def test_systemd_analyze_verifies_the_units(tmp_path):
    systemd_analyze()
    for args in ((), ("--user",)):
        out = tmp_path / "specops-llamacpp-cpu-draft.service"
        res = run("systemd", "examples/llamacpp-cpu-draft.yaml", *args, "-o", out)
        assert res.code == 0, res.stderr
        # a user unit verifies as a system one here (no user manager in a container): same syntax
        checked = verify(out)
        assert checked.returncode == 0 and checked.stderr.strip() == "", (args, checked.stderr)


def test_systemd_analyze_reads_quoted_paths(tmp_path):
    """A profile under a folder with a space, `%` and `$`: ExecStart quotes and escapes it so systemd
    runs the same path (verify accepts it, and unquoting gives the path back)."""
    systemd_analyze()
    folder = tmp_path / "my profiles 100% $HOME"
    path = write_profile(folder, "quoted")
    out = tmp_path / "specops-quoted.service"
    res = run("systemd", path, "-o", out)
    assert res.code == 0, res.stderr
    words = exec_words(one(parse_unit(out.read_text(encoding="utf-8")), "Service", "ExecStart"))
    assert words[2] == str(path)
    checked = verify(out)
    assert checked.returncode == 0 and checked.stderr.strip() == "", checked.stderr


def test_systemd_analyze_catches_a_broken_unit(tmp_path):
    """The verify check has teeth: a unit naming a program that does not exist fails it."""
    systemd_analyze()
    out = tmp_path / "specops-broken.service"
    res = run("systemd", "examples/llamacpp-cpu-draft.yaml", "--specops", "/nonexistent/bin/specops", "-o", out)
    assert res.code == 0, res.stderr
    assert verify(out).returncode != 0


@pytest.mark.parametrize("profile", ready_made_profiles() + sorted((ROOT / "examples").glob("*.yaml")), ids=str)
def test_every_shipped_profile_gets_a_unit_systemd_accepts(tmp_path, profile):
    variables = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", profile.read_text(encoding="utf-8")))
    env = {name: f"value-of-{name.lower()}-42" for name in variables if not name.startswith("SPECOPS_")}
    out = tmp_path / "unit.service"
    res = run("systemd", profile, "--run-as", "llm", "-o", out, env=env)
    assert res.code == 0, res.stderr
    text = out.read_text(encoding="utf-8")
    for value in env.values():
        assert value not in text
    unit = parse_unit(text)
    assert exec_words(one(unit, "Service", "ExecStart"))[2] == str(profile)
    if shutil.which("systemd-analyze"):
        checked = verify(out)
        assert checked.returncode == 0 and checked.stderr.strip() == "", checked.stderr


def test_exec_reload_sends_sighup_to_the_main_pid(tmp_path):
    """ExecReload, run the way systemd runs it ($MAINPID filled in, no shell), delivers SIGHUP: the signal
    `specops up` reloads its profile on (tests/test_reload_llamacpp.py)."""
    res = run("systemd", str(CPU_PROFILE))
    assert res.code == 0, res.stderr
    argv = exec_words(one(parse_unit(res.stdout), "Service", "ExecReload"))
    assert argv[-1] == "$MAINPID"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time\n"
            "signal.signal(signal.SIGHUP, lambda *a: sys.exit(7))\n"
            "print('ready', flush=True)\n"
            "time.sleep(30)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        sent = subprocess.run([*argv[:-1], str(child.pid)], capture_output=True, text=True, timeout=10)
        assert sent.returncode == 0, sent.stderr
        assert child.wait(timeout=10) == 7
    finally:
        stop_group(child, timeout=5)
        child.stdout.close()
