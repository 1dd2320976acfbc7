"""What a repo is, read from its config.json, model card and name: pure functions, no I/O.

Method signals (most specific first): the speculators format (``speculators_model_type``,
``speculators_config.algorithm``); EAGLE-3 (``*Eagle3*`` architectures, ``draft_vocab_size``,
``eagle_config``); Medusa (``medusa_num_heads``); MLP speculator (``model_type: mlp_speculator``); EAGLE-1
heads have no marker at all, so only the catalog or the repo name can say so. Which target a draft is
for, most trusted first: speculators ``verifier.name_or_path``, Medusa ``base_model_name_or_path``, the
card's ``base_model`` (sometimes wrong), the repo name. (The Maverick speculator's card,
for one, names another draft as its base model.)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from specops.methods import Method

#: Draft methods that are heads trained against one specific target (their identity matters).
HEAD_METHODS = frozenset({Method.EAGLE, Method.EAGLE3, Method.MEDUSA, Method.MLP_SPECULATOR})

_SPECULATORS_ALGORITHMS = {
    "eagle3": Method.EAGLE3,
    "eagle": Method.EAGLE,
    "hass": Method.EAGLE,
    "eagle2": Method.EAGLE,
    "mlp_speculator": Method.MLP_SPECULATOR,
    "mlp": Method.MLP_SPECULATOR,
}

#: Trust of a signal that ties a draft to a target (lower = more trusted); also the ranking order.
TRUST = {
    "catalog": 0,
    "speculators verifier": 1,
    "medusa base_model_name_or_path": 1,
    "card base_model": 2,
    "base_model tag": 2,
    "name": 3,
    "same family": 3,
    "target config": 1,
    "built-in": 4,
    "profile": 0,
}


@dataclass(frozen=True)
class ConfigFacts:
    """The numbers the compatibility checks need, from one config.json (None: not stated)."""

    vocab: int | None = None
    draft_vocab: int | None = None
    hidden: int | None = None
    target_hidden: int | None = None
    layers: int | None = None
    context: int | None = None
    aux_layer_ids: tuple[int, ...] | None = None
    mtp_layers: int | None = None
    model_type: str | None = None
    architectures: tuple[str, ...] = ()
    dtype: str | None = None

    def merged(self, other: ConfigFacts) -> ConfigFacts:
        """These facts, with gaps filled from ``other``."""
        values = {}
        for name in self.__dataclass_fields__:
            mine = getattr(self, name)
            values[name] = mine if mine not in (None, ()) else getattr(other, name)
        return ConfigFacts(**values)


@dataclass(frozen=True)
class Declared:
    """A statement that a draft is for some target, and where it was made."""

    target: str
    source: str

    @property
    def trust(self) -> int:
        return TRUST.get(self.source, 9)


#: Largest size-like number taken from a config (vocab, hidden size, layers, context): above it, the value is junk.
MAX_CONFIG_INT = 1 << 40


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_CONFIG_INT else None


def _dict(v: Any) -> dict:
    return v if isinstance(v, dict) else {}


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def plain(v: Any, limit: int = 256) -> bool:
    """A string fit to print and compare: at most ``limit`` characters, no control characters (a name from
    a config or a model card could otherwise carry terminal escape sequences into specops' output)."""
    return isinstance(v, str) and 0 < len(v) <= limit and not _CONTROL.search(v)


def _strs(v: Any) -> list[str]:
    """The plain strings of a list (a config field that should be a list of strings); [] for anything else."""
    return [x for x in v if plain(x)] if isinstance(v, list) else []


#: Keys of config.json that specops reads, with the JSON types each may have (None: null is allowed).
_INT_KEYS = (
    "vocab_size",
    "draft_vocab_size",
    "truncated_vocab_size",
    "hidden_size",
    "emb_dim",
    "n_embd",
    "d_model",
    "target_hidden_size",
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "num_nextn_predict_layers",
    "mtp_num_hidden_layers",
    "num_mtp_layers",
    "medusa_num_heads",
)
_STR_KEYS = ("model_type", "torch_dtype", "dtype", "speculators_model_type", "base_model_name_or_path")
_DICT_KEYS = ("transformer_layer_config", "text_config", "eagle_config", "speculators_config")
_LIST_KEYS = ("architectures",)


def _kind(v: Any) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
        int: "an integer",
        float: "a number",
    }.get(type(v), type(v).__name__)


def _problems(cfg: dict, where: str) -> list[str]:
    out = []
    for k in _INT_KEYS:
        v = cfg.get(k)
        if v is None or _int(v) is not None:
            continue
        if isinstance(v, float) and math.isfinite(v) and 0 <= v <= MAX_CONFIG_INT:
            continue  # a float where an integer belongs: not read, not hostile
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        out.append(
            f"{where}{k} must be a whole number from 0 to {MAX_CONFIG_INT}, not " + (f"{v!r}" if number else _kind(v))
        )
    for k in _STR_KEYS:
        v = cfg.get(k)
        if v is not None and not isinstance(v, str):
            out.append(f"{where}{k} must be a string, not {_kind(v)}")
    for k in _DICT_KEYS:
        v = cfg.get(k)
        if v is not None and not isinstance(v, dict):
            out.append(f"{where}{k} must be an object, not {_kind(v)}")
    for k in _LIST_KEYS:
        v = cfg.get(k)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            out.append(
                f"{where}{k} must be a list of strings, not "
                + (
                    _kind(v)
                    if not isinstance(v, list)
                    else "a list holding " + _kind(next(x for x in v if not isinstance(x, str)))
                )
            )
    return out


def config_problems(config: Any) -> list[str]:
    """What is wrong with a config.json's shape, for the keys specops reads (empty: usable). A hostile or
    broken config (``"architectures": 5``, a list of numbers, an object where a number belongs) is refused
    with these reasons rather than half-read."""
    if not isinstance(config, dict):
        return [f"config.json must be a JSON object, not {_kind(config)}"]
    out = _problems(config, "")
    for k in ("transformer_layer_config", "text_config", "eagle_config"):
        if isinstance(config.get(k), dict):
            out += _problems(config[k], f"{k}.")
    aux = config.get(
        "eagle_aux_hidden_state_layer_ids", _dict(config.get("eagle_config")).get("eagle_aux_hidden_state_layer_ids")
    )
    if aux is not None and not (isinstance(aux, list) and len(aux) <= 4096 and all(_int(x) is not None for x in aux)):
        out.append("eagle_aux_hidden_state_layer_ids must be a list of whole numbers")
    spec = config.get("speculators_config")
    if isinstance(spec, dict):
        if spec.get("algorithm") is not None and not isinstance(spec.get("algorithm"), str):
            out.append(f"speculators_config.algorithm must be a string, not {_kind(spec.get('algorithm'))}")
        verifier = spec.get("verifier")
        if verifier is not None and not isinstance(verifier, dict):
            out.append(f"speculators_config.verifier must be an object, not {_kind(verifier)}")
        elif (
            isinstance(verifier, dict)
            and verifier.get("name_or_path") is not None
            and not isinstance(verifier.get("name_or_path"), str)
        ):
            out.append(
                f"speculators_config.verifier.name_or_path must be a string, not {_kind(verifier.get('name_or_path'))}"
            )
    return out


def facts_from_config(config: dict | None) -> ConfigFacts:
    """Vocab, hidden size, layers, context, EAGLE-3 aux layers and MTP layers from a config.json.

    Never raises: values of the wrong type are left out (:func:`config_problems` says what they were)."""
    if not isinstance(config, dict):
        return ConfigFacts()
    inner = config.get("transformer_layer_config")  # speculators format keeps the layer config nested
    text = config.get("text_config")  # multimodal models keep the LM config nested
    layers_cfg = [c for c in (config, inner, text) if isinstance(c, dict)]

    def first(*keys):
        for c in layers_cfg:
            for k in keys:
                v = _int(c.get(k))
                if v is not None:
                    return v
        return None

    eagle_cfg = _dict(config.get("eagle_config"))
    aux = config.get("eagle_aux_hidden_state_layer_ids", eagle_cfg.get("eagle_aux_hidden_state_layer_ids"))
    aux_ids = (
        tuple(int(x) for x in aux)
        if isinstance(aux, list) and len(aux) <= 4096 and all(_int(x) is not None for x in aux)
        else None
    )
    mtp = None
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers"):
        for c in layers_cfg:
            if _int(c.get(key)) is not None:
                mtp = c[key]
                break
        if mtp is not None:
            break
    arch = _strs(config.get("architectures")) or _strs(_dict(inner).get("architectures"))
    dtype = config.get("torch_dtype") or config.get("dtype")
    return ConfigFacts(
        vocab=first("vocab_size"),
        draft_vocab=_int(config.get("draft_vocab_size")) or _int(config.get("truncated_vocab_size")),
        hidden=first("hidden_size", "emb_dim", "n_embd", "d_model"),
        target_hidden=_int(config.get("target_hidden_size")),
        layers=first("num_hidden_layers", "n_layer", "num_layers"),
        context=first("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"),
        aux_layer_ids=aux_ids,
        mtp_layers=mtp,
        model_type=config.get("model_type") if isinstance(config.get("model_type"), str) else None,
        architectures=tuple(arch),
        dtype=dtype if isinstance(dtype, str) else None,
    )


def detect_method(config: dict | None, repo_id: str = "") -> tuple[Method | None, str]:
    """The speculative method a draft repo is built for, and the evidence (``config: …`` or ``name: …``)."""
    cfg = config if isinstance(config, dict) else {}
    smt = cfg.get("speculators_model_type")
    algo = _dict(cfg.get("speculators_config")).get("algorithm")
    for value, key in ((smt, "speculators_model_type"), (algo, "speculators_config.algorithm")):
        if isinstance(value, str) and value.lower() in _SPECULATORS_ALGORITHMS:
            return _SPECULATORS_ALGORITHMS[value.lower()], f"config: {key} = {value}"
    archs = _strs(cfg.get("architectures"))
    if any("dspark" in a.lower() for a in archs):
        return Method.DSPARK, f"config: architectures = {archs[0]}"
    if any("dflash" in a.lower() for a in archs) or isinstance(cfg.get("dflash_config"), dict):
        return Method.DFLASH, "config: " + (f"architectures = {archs[0]}" if archs else "dflash_config")
    if any("eagle3" in a.lower() for a in archs):
        return Method.EAGLE3, f"config: architectures = {archs[0]}"
    if "draft_vocab_size" in cfg:
        return Method.EAGLE3, "config: draft_vocab_size"
    if isinstance(cfg.get("eagle_config"), dict):
        return Method.EAGLE3, "config: eagle_config"
    if "medusa_num_heads" in cfg or any("medusa" in a.lower() for a in archs):
        return Method.MEDUSA, "config: medusa_num_heads"
    if cfg.get("model_type") == "mlp_speculator" or any("mlpspeculator" in a.lower() for a in archs):
        return Method.MLP_SPECULATOR, "config: model_type = mlp_speculator"
    if any("eagle" in a.lower() for a in archs):
        return Method.EAGLE, f"config: architectures = {archs[0]}"
    return detect_method_from_name(repo_id)


def detect_method_from_name(repo_id: str) -> tuple[Method | None, str]:
    name = repo_id.rsplit("/", 1)[-1].lower()
    if "dspark" in name:
        return Method.DSPARK, "name: dspark"
    if "dflash" in name:
        return Method.DFLASH, "name: dflash"
    if re.search(r"eagle-?3", name):
        return Method.EAGLE3, "name: eagle3"
    if "eagle" in name:
        return Method.EAGLE, "name: eagle (EAGLE-1 heads carry no config marker)"
    if "medusa" in name:
        return Method.MEDUSA, "name: medusa"
    if "accelerator" in name or "mlp-speculator" in name or "mlp_speculator" in name:
        return Method.MLP_SPECULATOR, "name: accelerator"
    if "speculator" in name:
        return Method.EAGLE3, "name: speculator (speculators repos are EAGLE-3 unless the config says otherwise)"
    return None, "no method marker in config.json or name"


def looks_like_full_model(config: dict | None) -> bool:
    """A complete LM (several layers, no head markers): a draft_model, not an EAGLE head."""
    facts = facts_from_config(config)
    method, _ = detect_method(config, "")
    return method is None and (facts.layers or 0) > 2


def declared_targets(config: dict | None, card_data: dict | None) -> list[Declared]:
    """Statements of which target a draft is for, most trusted first."""
    out: list[Declared] = []
    cfg = config if isinstance(config, dict) else {}
    spec = cfg.get("speculators_config")
    if isinstance(spec, dict) and isinstance(spec.get("verifier"), dict):
        v = spec["verifier"].get("name_or_path")
        if plain(v):
            out.append(Declared(v, "speculators verifier"))
    base = cfg.get("base_model_name_or_path")
    if plain(base) and ("medusa_num_heads" in cfg or "medusa" in " ".join(_strs(cfg.get("architectures"))).lower()):
        out.append(Declared(base, "medusa base_model_name_or_path"))
    card = card_data if isinstance(card_data, dict) else {}
    bases = card.get("base_model")
    for b in ([bases] if isinstance(bases, str) else bases if isinstance(bases, list) else [])[:32]:
        if plain(b):
            out.append(Declared(b, "card base_model"))
    return out


# ------------------------------------------------------------------------------------------- names

_FAMILIES = (
    "llama",
    "qwen",
    "mistral",
    "mixtral",
    "vicuna",
    "gemma",
    "phi",
    "deepseek",
    "glm",
    "gpt-oss",
    "mimo",
    "granite",
    "olmo",
    "falcon",
    "yi",
    "internlm",
    "baichuan",
    "codellama",
    "starcoder",
    "smollm",
)
_QUANT_WORDS = (
    "gguf",
    "awq",
    "gptq",
    "fp8",
    "int4",
    "int8",
    "w4a16",
    "w8a8",
    "bnb",
    "4bit",
    "8bit",
    "exl2",
    "mlx",
    "nvfp4",
    "fp4",
    "quantized",
)
_HEAD_WORDS = ("eagle", "medusa", "speculator", "accelerator", "mtp", "draft", "lora", "adapter")


def short_name(repo_id: str) -> str:
    return PurePosixPath(repo_id.rstrip("/")).name


def name_key(repo_id: str) -> str:
    """A normalised name for comparing ids (case, ``Meta-`` prefix and separators ignored)."""
    name = short_name(repo_id).lower()
    name = re.sub(r"^meta-(?=llama)", "", name)
    return re.sub(r"[^a-z0-9.]", "", name)


@dataclass(frozen=True)
class NameInfo:
    family: str | None
    version: str | None
    size_b: float | None  # parameters in billions from the name (8x7B -> 56; 30B-A3B -> 30)
    tuned: bool  # instruct / chat / -it / RL variant
    quantized: bool
    head: bool  # names a draft head rather than a model
    tokens: frozenset[str] = field(default_factory=frozenset)


def name_info(repo_id: str) -> NameInfo:
    name = short_name(repo_id).lower().replace("_", "-")
    name = re.sub(r"^meta-(?=llama)", "", name)
    family = version = None
    m = re.search(r"(" + "|".join(re.escape(f) for f in _FAMILIES) + r")[-\s]?(\d+(?:\.\d+)?)?", name)
    if m:
        family = m.group(1)
        version = m.group(2)
        # "llama3.1" / "llama-3.1" / "qwen2.5"; a number followed by "b" is a size, not a version
        rest = name[m.start(2) :] if version else ""
        if version and (re.match(r"\d+(?:\.\d+)?b(?![a-z])", rest) or re.match(r"\d+x", rest)):
            version = None
    size = None
    moe = re.search(r"(\d+)x(\d+(?:\.\d+)?)b", name)
    if moe:
        size = int(moe.group(1)) * float(moe.group(2))
    else:
        sizes = [float(s) for s in re.findall(r"(?<![a-z0-9.])(\d+(?:\.\d+)?)b(?![a-z0-9])", name)]
        if sizes:
            size = sizes[0]
        else:
            mm = re.search(r"(?<![a-z0-9.])(\d+(?:\.\d+)?)m(?![a-z0-9])", name)
            if mm:
                size = float(mm.group(1)) / 1000
    tuned = bool(re.search(r"instruct|chat|(?<![a-z])it(?![a-z])|-rl\b|coder-instruct", name))
    tokens = frozenset(t for t in re.split(r"[-.\s]+", name) if t)
    return NameInfo(
        family, version, size, tuned, any(q in name for q in _QUANT_WORDS), any(h in name for h in _HEAD_WORDS), tokens
    )


def names_match(target_id: str, repo_id: str) -> bool:
    """Whether a draft's repo name names the target: same family, version (when both say) and size."""
    t, r = name_info(target_id), name_info(repo_id)
    if not t.family or t.family != r.family:
        return False
    if t.version and r.version and t.version != r.version:
        return False
    if t.version and not r.version:
        return False
    if t.size_b is None or r.size_b is None:
        return False
    return abs(t.size_b - r.size_b) < 1e-6


def same_family_smaller(target_id: str, repo_id: str, *, max_ratio: float = 0.25) -> bool:
    """A same-family model at most ``max_ratio`` of the target's size, tuned like the target, unquantised
    (the quantisation check is left to the caller for GGUF repos)."""
    t, r = name_info(target_id), name_info(repo_id)
    if not t.family or t.family != r.family or r.head:
        return False
    major = lambda v: (v or "").split(".")[0]  # noqa: E731
    if t.version and r.version and major(t.version) != major(r.version):
        return False
    if t.size_b is None or r.size_b is None or r.size_b > t.size_b * max_ratio:
        return False
    return t.tuned == r.tuned


def same_model(a: str, b: str, aliases: dict[str, str] | None = None) -> bool:
    """Whether two model references name the same model (ids case-insensitive, aliases applied; a local
    path matches an id with the same name)."""

    def canon(x: str) -> str:
        x = x.strip().rstrip("/")
        if aliases:
            x = aliases.get(x.lower(), x)
        return x.lower()

    ca, cb = canon(a), canon(b)
    if ca == cb:
        return True
    if a.startswith(("/", ".", "~")) or b.startswith(("/", ".", "~")):
        return name_key(a) == name_key(b)
    return False
