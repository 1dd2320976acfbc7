"""The verification-cost curve of an engine on the machine it runs on, kept per machine, and read by the models.

The speedup model (:mod:`specops.speedup`) needs c_verify(n): what one speculative step whose target pass covers
n = k + 1 tokens (k drafted) costs, in target decode steps; c: what one draft step costs; and what a step of the
speculative engine costs when it found no draft. :mod:`specops.perf.verifyprobe` times them from the steps the
engine really takes; this module keeps the record and reads it: the curve at a batch (interpolated between the
batches probed), the target's step time, a draft model's c.

The curve is stored as a small JSON in the state folder (``verify-cost/``: a measurement of this machine, like
an instance's state; ``$SPECOPS_STATE``), keyed by engine, engine version, model and device (CPU model and
cores, or GPU names), so another machine or model never reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from specops.methods import Method
from specops.paths import private_dir, state_dir
from specops.speedup import VerifyCost

#: What :func:`specops.perf.verifyprobe.probe_profile` writes in ``probe`` (a record without it timed prompt
#: passes: a lower bound).
STEPS = "speculative-steps"


# ----------------------------------------------------------------------------------------------- the device


def cpu_model() -> str:
    """The CPU model as ``/proc/cpuinfo`` names it ("" where it does not)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return ""


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 0


def cpu_name() -> str:
    """The CPU model and the cores this process may use."""
    return f"{cpu_model() or 'unknown CPU'}, {usable_cores()} cores"


def gpu_names(devices: list[int] | None) -> list[str]:
    """Names of the GPUs ``devices`` (None: all) as nvidia-smi lists them; [] without nvidia-smi or GPUs."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    names = []
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        idx, _, name = line.partition(",")
        if idx.strip().isdigit() and (devices is None or int(idx) in devices):
            names.append(name.strip())
    return names


def device_of(profile) -> str:
    """What the profile's engine runs on: ``GPU: <names>``, or ``CPU: <model>, <cores> cores``."""
    devices = profile.gpus.devices
    return device_name(gpu_names(devices) if devices != [] else [])


def device_name(gpus: list[str]) -> str:
    """``GPU: <names>`` for the GPUs an engine uses; ``CPU: <model>, <cores> cores`` without any."""
    return f"GPU: {', '.join(gpus)}" if gpus else f"CPU: {cpu_name()}"


def model_identity(model_id: str) -> str:
    """A local file as its real path and size (a changed file is another model); a Hub id as given."""
    p = Path(model_id).expanduser()
    if p.is_file():
        return f"{p.resolve()} ({p.stat().st_size} bytes)"
    return model_id


@dataclass(frozen=True)
class CurveKey:
    """What a curve is valid for."""

    engine: str
    version: str
    model: str
    device: str

    @classmethod
    def of(cls, profile, engine_version: str | None) -> CurveKey:
        """The key of ``profile``'s engine (at ``engine_version``), model and device."""
        return cls.for_model(profile.backend, engine_version, profile.model.id, profile.model.file, device_of(profile))

    @classmethod
    def for_model(cls, engine: str, version: str | None, model_id: str, file: str | None, device: str) -> CurveKey:
        ident = model_identity(model_id) + (f" {file}" if file else "")
        return cls(engine, version or "unknown", ident, device)

    def path(self, root: Path | None = None) -> Path:
        digest = hashlib.sha256(json.dumps([self.engine, self.version, self.model, self.device]).encode()).hexdigest()
        return (root or curves_dir()) / f"{self.engine}-{digest[:16]}.json"


def curves_dir() -> Path:
    return state_dir() / "verify-cost"


# ----------------------------------------------------------------------------------------------- storing


def save_curve(key: CurveKey, record: dict, root: Path | None = None) -> tuple[dict, Path]:
    """Write the probe's ``record`` (see :func:`probe_profile`) for ``key``; returns it with the key, and the file.
    Draft costs stored earlier for the same key and kind of probe are kept beside the new ones."""
    path = key.path(root)
    private_dir(path.parent)
    old = load_record(key, root)
    drafts = (old or {}).get("drafts") if (old or {}).get("probe") == record.get("probe") else None
    data = {"engine": key.engine, "version": key.version, "model": key.model, "device": key.device, **record}
    if drafts:
        data["drafts"] = {**drafts, **(record.get("drafts") or {})}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return data, path


def _batches(record: dict) -> dict[int, dict]:
    """The record's curves by batch size: ``batches``, or its one curve (``relative``) at batch 1."""
    out = {}
    for b, curve in (record.get("batches") or {}).items():
        if isinstance(curve, dict) and str(b).isdigit() and int(b) >= 1 and curve.get("relative"):
            out[int(b)] = curve["relative"]
    return out or {1: record.get("relative") or {}}


def _between(by_batch: dict[int, dict], batch: int) -> tuple[dict, str]:
    """The relative costs at ``batch``: a measured batch's, else linear between the two around it (at the sizes
    both have), else the nearest one's; and which batches it came from."""
    sizes = sorted(by_batch)
    lo = max((b for b in sizes if b <= batch), default=sizes[0])
    hi = min((b for b in sizes if b >= batch), default=sizes[-1])
    if lo == hi:
        return by_batch[lo], f"batch {lo}"
    w = (batch - lo) / (hi - lo)
    common = [n for n in by_batch[lo] if n in by_batch[hi]]
    mixed = {n: float(by_batch[lo][n]) + w * (float(by_batch[hi][n]) - float(by_batch[lo][n])) for n in common}
    return mixed, f"batch {batch} between {lo} and {hi}"


def curve_of(record: dict, batch: int = 1) -> VerifyCost:
    """The :class:`VerifyCost` of a stored or fresh record at ``batch`` requests decoded at once; ValueError when
    it holds none."""
    costs, which = _between(_batches(record), max(1, int(batch)))
    source = f"{record.get('engine')} {record.get('version')} on {record.get('device')}, {record.get('date')}"
    if record.get("probe") == STEPS:
        source += f", speculative steps at {which}"
    return VerifyCost.from_mapping(costs, source, idle_of(record, batch))


def idle_measured(record: dict | None) -> bool:
    """Whether ``record`` timed the speculative engine's draftless step (records probed before it did not)."""
    return bool(record) and any(isinstance(c, dict) and "idle" in c for c in (record.get("batches") or {}).values())


def idle_of(record: dict, batch: int = 1) -> float:
    """A draftless step of the speculative engine at ``batch``, in decode steps (interpolated as the curve is);
    1 in a record that did not time it."""
    idle = _at_batch(_per_batch(record, "idle"), batch)
    return 1.0 if idle is None else idle


def step_ms(record: dict, batch: int = 1) -> float | None:
    """The target's decode step in ms at ``batch`` (interpolated as the curve is), or None in a record without it."""
    steps = _per_batch(record, "t_step_ms")
    if not steps and (one := _positive(record.get("t_step_ms"))) is not None:
        steps = {1: one}
    return _at_batch(steps, batch)


def _per_batch(record: dict, key: str) -> dict[int, float]:
    """The positive number ``key`` of each batch the record measured it at."""
    out = {}
    for batch, cell in (record.get("batches") or {}).items():
        value = _positive(cell.get(key)) if isinstance(cell, dict) else None
        if str(batch).isdigit() and value is not None:
            out[int(batch)] = value
    return out


def _positive(value) -> float | None:
    """``value`` as a float when it is a positive number (a hand-edited JSON true is no number), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def _at_batch(values: dict[int, float], batch: int) -> float | None:
    """One number measured per batch, at ``batch`` (interpolated as the curve is); None where none was."""
    if not values:
        return None
    return float(_between({b: {"v": v} for b, v in values.items()}, max(1, int(batch)))[0]["v"])


#: The fields of a Hugging Face ``config.json`` that set what one forward pass computes: two drafts that agree
#: on all of them cost the same step, whatever their weights (a fine-tuned copy of a measured draft).
SHAPE_FIELDS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
    "torch_dtype",
    "dtype",
    "quantization_config",
)


def draft_shape(draft: str | None) -> str | None:
    """What a step of the draft model in folder ``draft`` computes, as its ``config.json``'s
    :data:`SHAPE_FIELDS` (a canonical JSON string); None for anything else (a GGUF file, a Hub id, no config)."""
    try:
        config = json.loads((Path(draft).expanduser() / "config.json").read_text(encoding="utf-8")) if draft else None
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(config, dict) or not config.get("model_type"):
        return None
    return json.dumps({k: config.get(k) for k in SHAPE_FIELDS}, sort_keys=True, default=str)


def draft_ratio(record: dict, draft: str | None, batch: int = 1) -> float | None:
    """c: the measured cost of a step of the draft model ``draft`` in target steps at ``batch`` (interpolated as
    the curve is), or None when the record has measured neither that draft nor one of its shape
    (:func:`draft_shape`: the entry's stored shape, else its folder's if it is still there)."""
    drafts = record.get("drafts") or {}
    entry = drafts.get(model_identity(draft)) if draft else None
    entry = entry or next((d for d in drafts.values() if draft and d.get("path") == draft), None)
    shape = draft_shape(draft) if entry is None else None
    if shape is not None:
        entry = next((d for d in drafts.values() if (d.get("shape") or draft_shape(d.get("path"))) == shape), None)
    ratios = {int(b): v for b, v in ((entry or {}).get("ratio") or {}).items() if str(b).isdigit()}
    return _at_batch(ratios, batch)


def drafts_by_model(profile) -> bool:
    """Whether ``profile`` drafts by a draft model of its own (the probe then times its steps; c is measured)."""
    return profile.speculative.method is Method.DRAFT_MODEL and bool(profile.speculative.draft)


def covers(record: dict | None, profile) -> bool:
    """Whether ``record`` holds what the model needs for ``profile``: speculative steps, and the cost of its
    draft model when it has one."""
    if not record or record.get("probe") != STEPS:
        return False
    spec = profile.speculative
    return spec.method is not Method.DRAFT_MODEL or draft_ratio(record, spec.draft) is not None


def load_record(key: CurveKey, root: Path | None = None) -> dict | None:
    """The record stored for exactly ``key`` (engine, version, model, device), or None. A file that is not a
    curve, or whose key differs (a hash collision, a hand edit), counts as none."""
    try:
        data = json.loads(key.path(root).read_text(encoding="utf-8"))
        fields = [data.get(f) for f in ("engine", "version", "model", "device")] if isinstance(data, dict) else None
        if fields != [key.engine, key.version, key.model, key.device]:
            return None
        curve_of(data)
        return data
    except (OSError, ValueError, RecursionError, TypeError, AttributeError):
        return None


def load_curve(key: CurveKey, root: Path | None = None) -> VerifyCost | None:
    """The curve stored for exactly ``key``, or None."""
    record = load_record(key, root)
    return None if record is None else curve_of(record)


def curve_for(profile, engine_version: str | None) -> VerifyCost | None:
    """The curve measured for ``profile``'s engine, model and device here, or None (none probed yet)."""
    return load_curve(CurveKey.of(profile, engine_version))


def decision_curve(profile, engine_version: str | None) -> VerifyCost | None:
    """:func:`curve_for`, its ``source`` the file it was read from: the fallback's decisions name the curve they
    predicted on (:mod:`specops.watch.rule`)."""
    key = CurveKey.of(profile, engine_version)
    curve = load_curve(key)
    return None if curve is None else VerifyCost(curve.points, str(key.path()))


def decision_draft_cost(profile, engine_version: str | None) -> float | None:
    """c as the stored record of ``profile``'s engine, model and machine measured it, for the fallback's model:
    0 for prompt lookup (its lookup is inside the speculative steps the record timed), the draft model's own
    steps for a draft model the record timed; None where the record has no speculative steps or that draft."""
    record = load_record(CurveKey.of(profile, engine_version))
    if record is None or record.get("probe") != STEPS:
        return None
    if profile.speculative.method in (Method.NGRAM, Method.SUFFIX):
        return 0.0
    return draft_ratio(record, profile.speculative.draft) if drafts_by_model(profile) else None


def format_curve(record: dict) -> str:
    """The curve as a person reads it."""
    lines = [
        f"verification cost of {record.get('engine')} {record.get('version')} on {record.get('device')}",
        f"model {record.get('model')}; measured {record.get('date')} ({record.get('probe') or 'prompt passes'}), "
        f"{record.get('repeats')} repeats",
    ]
    for b, c in sorted(_record_batches(record).items()):
        lines.append(f"batch {b}: a decode step takes {c.get('t_step_ms')} ms")
        lines.append("   n   t_step+verify ms   cost (steps)")
        for n, rel in (c.get("relative") or {}).items():
            lines.append(f"  {int(n):2d}   {c['t_verify_ms'][n]:16.2f}   {rel:12.2f}")
        if c.get("idle") is not None:
            lines.append(f"  a step that found no draft: {c['t_idle_ms']:.2f} ms, {c['idle']:.2f} steps")
    for draft in (record.get("drafts") or {}).values():
        ratio = ", ".join(f"{v} at batch {b}" for b, v in (draft.get("ratio") or {}).items())
        lines.append(f"draft {draft.get('path')}: a step costs {ratio} target steps")
    how = record.get("how") or {}
    lines.append(f"measured: {how.get('measured')}; inferred: {how.get('inferred')}")
    if record.get("busy"):
        lines.append(
            f"⚠ busy machine: other processes kept {record.get('other_cores')} cores busy during the probe, so these "
            "costs include theirs; probe again when the machine is quiet (specops bench PROFILE --probe-verify)"
        )
    return "\n".join(lines) + "\n"


def _record_batches(record: dict) -> dict[int, dict]:
    batches = {int(b): c for b, c in (record.get("batches") or {}).items() if str(b).isdigit()}
    return batches or {1: record}
