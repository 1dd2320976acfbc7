"""From a validated profile to the exact command line, and the printed forms of that plan.

Rendering is deterministic: the same profile and engine version give byte-identical output, so a GitOps
diff of ``specops render`` shows exactly what a merge would change on the servers.

Values that ``${VAR}`` took from the environment are secret (see :mod:`specops.redact`). To hide them
exactly where they landed, whatever the backend did with them (joined into ``repo:QUANT``, escaped into a
JSON config), the plan is rendered a second time from a *probe* profile in which each such value is
replaced by a marker; a printed element that differs between the two renders depends on the secret, and
shows ``***`` where the marker stands (or, when the marker cannot be followed, in its place as a whole).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any

from pydantic import BaseModel

from specops.backends.base import EngineInfo, LaunchPlan, RenderError
from specops.config.located import format_path
from specops.config.profile import LoadedProfile, Profile
from specops.errors import ProfileError, SpecopsError
from specops.methods import NEEDS_DRAFT
from specops.redact import MARK, EnvText, redact_message

FORMATS = ("shell", "json", "args")


def render_plan(
    loaded: LoadedProfile,
    registry,
    *,
    engine: EngineInfo | None = None,
    backend_version: str | None = None,
    probe: bool = True,
    host: str | None = None,
    port: int | None = None,
) -> LaunchPlan:
    """Render ``loaded`` for its backend; render errors come back located in the profile."""
    backend = registry.backend(loaded.profile.backend)
    texts = list(loaded.document.env_texts)
    if engine is None:
        try:
            engine = backend.engine_info(loaded.profile, backend_version, probe=probe)
        except ProfileError:
            raise
        except SpecopsError as exc:
            if not texts:
                raise
            hidden = redact_message(str(exc), "", texts, format_path)
            raise type(exc)(hidden) if type(exc).__init__ is SpecopsError.__init__ else SpecopsError(hidden) from None
    method = loaded.profile.speculative.method
    problem = backend.method_problem(method, engine.version, cpu=loaded.profile.gpus.devices == [])
    if problem:
        raise ProfileError([loaded.problem(("speculative", "method"), problem)])
    support = backend.support(method, engine.version)

    def plan_for(profile: Profile) -> LaunchPlan:
        plan = backend.render(profile, engine, host=host, port=port)
        return dataclasses.replace(plan, notes=(*plan.notes, support[1])) if support else plan

    try:
        result = plan_for(loaded.profile)
    except RenderError as exc:
        raise ProfileError([loaded.problem(exc.path, str(exc))]) from None
    if texts:
        result = with_env_secrets(result, loaded.profile, texts, plan_for)
    return result


def format_plan(p: LaunchPlan, fmt: str) -> str:
    """``shell``: one paste-able line; ``json``: argv, env and URLs; ``args``: one argument per line."""
    if fmt == "shell":
        return p.shell() + "\n"
    if fmt == "json":
        return json.dumps(p.to_dict(), indent=2) + "\n"
    if fmt == "args":
        d = p.to_dict()
        lines = [f"{k}={v}" for k, v in d["env"].items()] + d["argv"]
        return "\n".join(lines) + "\n"
    raise ValueError(f"unknown format {fmt!r}")


# ---------------------------------------------------------------------------------------------------
# values from the environment


def _marker(i: int) -> str:
    # letters and digits only: survives JSON, repr, shell quoting and path handling unchanged
    return f"specopsenvmark{i}x"


def with_env_secrets(result: LaunchPlan, profile: Profile, texts: list[EnvText], render) -> LaunchPlan:
    """``result`` with the interpolated secrets ``texts`` registered and their printed positions marked."""
    secrets = tuple(dict.fromkeys(result.secrets + tuple(v for t in texts for v in t.values)))
    masks = tuple(dict.fromkeys(result.masks + tuple((t.text, t.masked()) for t in texts if t.text != t.masked())))
    display = None
    probe_profile, markers = _probe_profile(profile, texts)
    if markers or probe_profile is not profile:
        try:
            probed = render(probe_profile)
        except Exception:  # the probe is only for printing: the real plan rendered, so print conservatively
            probed = None
        display = _display(result.raw_dict(), probed.raw_dict() if probed is not None else None, markers)
    return dataclasses.replace(result, secrets=secrets, masks=masks, display=display)


def _probe_paths(profile: Profile, texts: list[EnvText]) -> list[EnvText]:
    """The interpolated texts still in ``profile`` at their paths (or moved there by a fallback step)."""
    out = []
    for t in texts:
        if _same(_get(profile, t.path), t.text):
            out.append(t)
        # a fallback step's draft becomes speculative.draft when the supervisor switches to it
        if len(t.path) == 4 and t.path[:2] == ("fallback", "chain") and t.path[3] == "draft":
            spec = profile.speculative
            if spec.method in NEEDS_DRAFT and spec.draft == t.text:
                out.append(dataclasses.replace(t, path=("speculative", "draft")))
    return out


def _probe_profile(profile: Profile, texts: list[EnvText]) -> tuple[Profile, dict[str, str]]:
    """``profile`` with every secret value replaced: text by markers, a number by another number."""
    markers: dict[str, str] = {}
    probe = profile
    for t in _probe_paths(profile, texts):
        current = _get(probe, t.path)
        if isinstance(current, str):
            new, pos = "", 0
            for start, end, _name in t.spans:
                marker = _marker(len(markers))
                markers[marker] = t.text[start:end]
                new += t.text[pos:start] + marker
                pos = end
            new += t.text[pos:]
        elif isinstance(current, bool) or not isinstance(current, (int, float)):
            continue  # booleans and choices (methods, modes) are not secrets once validated
        elif isinstance(current, int):
            new = current + 1 if current < 65535 else current - 1
        else:
            new = current / 2 if current else 0.5
        probe = _replace(probe, t.path, new)
    return probe, markers


_MISSING = object()


def _same(value: Any, text: str) -> bool:
    """Whether ``value`` in the profile is still what ``text`` became (pydantic turns "8000" into 8000)."""
    if isinstance(value, str):
        return value == text
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return float(text.strip()) == value
    except ValueError:
        return False


def _get(node: Any, path: tuple) -> Any:
    for part in path:
        if isinstance(node, BaseModel):
            node = (
                getattr(node, part, _MISSING) if isinstance(part, str) and part in type(node).model_fields else _MISSING
            )
        elif isinstance(node, dict):
            node = node.get(part, _MISSING)
        elif isinstance(node, (list, tuple)) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            return _MISSING
        if node is _MISSING:
            return _MISSING
    return node


def _replace(node: Any, path: tuple, value: Any) -> Any:
    """A copy of ``node`` with ``value`` at ``path`` (models copied without validation: markers stay)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(node, BaseModel):
        return node.model_copy(update={head: _replace(getattr(node, head), rest, value)})
    if isinstance(node, dict):
        return {**node, head: _replace(node[head], rest, value)}
    if isinstance(node, list):
        return [(_replace(v, rest, value) if i == head else v) for i, v in enumerate(node)]
    if isinstance(node, tuple):
        return tuple((_replace(v, rest, value) if i == head else v) for i, v in enumerate(node))
    return node


def _display(real: Any, probe: Any, markers: dict[str, str]) -> Any:
    """The printed form of ``real``: where the probe differs, the secret's place is marked."""
    if probe is None:  # the probe did not render: every value that holds a secret is searched for instead
        return real
    if isinstance(real, dict) and isinstance(probe, dict):
        return {k: (_display(v, probe[k], markers) if k in probe else _whole(v)) for k, v in real.items()}
    if isinstance(real, list) and isinstance(probe, list):
        if len(real) == len(probe):
            return [_display(r, q, markers) for r, q in zip(real, probe)]
        out: list = []
        matcher = difflib.SequenceMatcher(None, real, probe, autojunk=False)
        for op, i1, i2, j1, j2 in matcher.get_opcodes():
            if op == "equal":
                out += real[i1:i2]
            elif op == "replace" and i2 - i1 == j2 - j1:
                out += [_display(r, q, markers) for r, q in zip(real[i1:i2], probe[j1:j2])]
            else:
                out += [_whole(r) for r in real[i1:i2]]
        return out
    if real == probe:
        return real
    if isinstance(real, str) and isinstance(probe, str):
        restored = probe
        for marker, value in markers.items():
            restored = restored.replace(marker, value)
        if restored == real and any(m in probe for m in markers):
            for marker in markers:
                probe = probe.replace(marker, MARK)
            return probe
    return _whole(real)


def _whole(value: Any) -> Any:
    if isinstance(value, str):
        return MARK
    if isinstance(value, list):
        return [_whole(v) for v in value]
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    return value
