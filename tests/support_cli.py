"""Running the real ``specops`` entry point in-process (fast) or in a subprocess (true isolation).

In-process runs go through :func:`specops.cli.main` itself, so exit codes and the error printing are the
ones a user gets; ``click.testing`` only captures the streams and swaps the environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from click.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "profiles"
SPECOPS = Path(sys.executable).parent / "specops"


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        return [line for line in (self.stdout + self.stderr).splitlines() if line.strip()]


def run(*args: str, env: dict | None = None) -> Result:
    """``specops ARGS`` in-process; ``env`` overrides os.environ (a value of None unsets the variable)."""
    from specops.cli import main

    with CliRunner().isolation(env=env) as (out, err, _mixed):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return Result(code, out.getvalue().decode(), err.getvalue().decode())


def run_subprocess(*args: str, env: dict | None = None, cwd: Path = ROOT, timeout: float = 60) -> Result:
    """``specops ARGS`` as a separate process (the installed console script of this interpreter)."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [str(SPECOPS), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={k: v for k, v in full_env.items() if v is not None},
        timeout=timeout,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def ready_made_profiles() -> list[Path]:
    """Every deployable profile under profiles/ (GitOps bases, which lack a name, excluded)."""
    import yaml

    out = []
    for path in sorted(PROFILES.rglob("*.yaml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and "name" in data:
            out.append(path)
    return out
