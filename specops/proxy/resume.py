"""A started stream whose engine failed, continued on a live engine from the text already sent.

A stream the client has begun to read cannot be retried: it holds the first tokens. When its engine dies (the
connection resets, or ends before ``[DONE]``) or is cut (``upstream_failed``, a drain's timeout), the proxy sends
the rest of the request to a live engine (a twin, a remote twin, the restarted engine) and the client's stream
goes on, drawn from the same model's distribution:

- ``/v1/completions``: the prompt followed by the text sent; ``echo`` off (the client has its echo);
- ``/v1/chat/completions``: the messages plus an assistant message holding the text sent, with
  ``continue_final_message: true, add_generation_prompt: false``; vLLM and llama-server both take these two fields
  (llama-server's ``tools/server/server-common.cpp``; its streamed deltas then hold only the new text);
- ``max_tokens`` (``max_completion_tokens``, llama-server's ``n_predict``) less the tokens sent; none left, or a
  ``finish_reason`` already sent: the stream is ended here, with no engine.

The continuation's events are rewritten into the client's stream (:meth:`Resumable.rewrite`): the original's
``id``, ``model`` and ``created``; chat's opening role-only chunk dropped; token counts as one answer:
``usage.completion_tokens`` (and llama-server's ``timings.predicted_n``) plus the tokens sent before,
``usage.prompt_tokens`` less them (the text sent was the answer, not the prompt; the engine tokenizing the joined
text may move a token across the seam). The tokens sent are the engine's own running count where it gave one
(``timings.predicted_n`` with ``timings_per_token``, which ``specops up`` asks llama-server for; vLLM's
``continuous_usage_stats``), else the events that carried text (one token each, as both engines stream without
speculation; a vLLM event carrying several speculated tokens makes this an undercount, and the continuation may
then generate a few tokens past ``max_tokens``).

Not continued (:meth:`Resumable.obstacle`): the stream ends with an error event (``data: {"error": {...}}`` and no
``[DONE]``: OpenAI's clients raise ``APIError`` on that event, and a client that ignores it does not take a cut
answer for a whole one), counted by reason:

- ``options``: what the request asked or the stream held makes a continuation unsound: ``n``/``best_of`` > 1
  (several answers interleaved), ``logprobs``/``top_logprobs``/``n_probs`` (offsets and alternatives of the joined
  answer would be wrong), constrained output (``response_format`` other than text, ``grammar``, ``json_schema``,
  ``guided_*``, ``structured_outputs``: the grammar would restart mid-answer), a prompt of token ids or several
  prompts, a chat ending in an assistant message not itself continued, a tool call or reasoning text streamed (a
  call cut mid-arguments cannot be resumed as text), an error event from the engine;
- ``not_kept``: the request body was not kept (another path, or the proxy held more than half of
  ``max_buffered_bytes`` when the stream started: new requests come first);
- ``no_engine``: no live engine within ``queue_timeout`` (or specops is stopping);
- ``refused``: the engine answered the continuation with an error status or no event stream;
- ``limit``: the stream broke :data:`MAX_CONTINUATIONS` times.

The proxy keeps a continuable stream's request body until it ends, held against ``max_buffered_bytes``, and what
it sent: raw bytes on the hot path, parsed only when they pass :data:`FOLD_AT` or the stream breaks.
"""

from __future__ import annotations

import json
from typing import Any

#: The paths a stream can be continued on (the OpenAI completions and chat completions APIs).
CONTINUABLE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
#: Continuations one stream may take (its engine failing again, or the continuation's engine too).
MAX_CONTINUATIONS = 3
#: What a stream keeps of its sent bytes before parsing them into text (most streams are never parsed).
FOLD_AT = 64 * 1024

_DONE = b"data: [DONE]\n\n"
_ENGINE_ERROR = "the engine reported an error in the stream"
_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")
_CONSTRAINTS = (
    "grammar",
    "json_schema",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


class Resumable:
    """One started stream of a completions or chat request: its client response, its request body (kept), and what
    the client has received (:meth:`feed`); builds the continuation (:meth:`request_body`) and rewrites its events
    (:meth:`rewrite`)."""

    __slots__ = (
        "body",
        "chat",
        "continuations",
        "counted",
        "done",
        "finished",
        "head",
        "held",
        "obstacle_seen",
        "offset",
        "partial",
        "pending",
        "pending_size",
        "resp",
        "skip_role",
        "text",
        "text_events",
        "unread",
    )

    def __init__(self, path: str, body: Any, resp: Any):
        self.chat = path == "/v1/chat/completions"
        self.body = body  # the HeldBody, kept until the request ends
        self.resp = resp  # the client's response, prepared: every continuation writes into it
        self.pending: list[bytes] = []  # sent bytes not parsed yet
        self.pending_size = 0
        self.partial = b""  # an event not complete yet (parsed bytes)
        self.text: list[str] = []
        self.text_events = 0  # events that carried text
        self.counted: int | None = None  # the engine's own running count of the tokens sent
        self.head: dict | None = None  # id, object, created, model of the client's stream
        self.finished = False  # a finish_reason was sent
        self.done = False  # [DONE] was sent
        self.obstacle_seen: str | None = None  # what the stream held that a continuation cannot carry on
        self.continuations = 0
        self.offset = 0  # tokens sent before the continuation running now
        self.skip_role = False
        self.unread = b""  # the continuation's bytes not yet a complete event
        self.held = b""  # the engine's bytes not yet a complete event (not sent to the client yet)

    # ------------------------------------------------------------------------------------------ what was sent

    def hold(self, chunk: bytes) -> bytes:
        """What of the engine's ``chunk`` goes to the client now: its complete events (the hot path: one
        ``rfind`` when the chunk ends an event, as the engines' chunks do). An event's start waits for its end,
        so a continuation never follows half an event; past :data:`FOLD_AT` without an end it goes as it is."""
        data = self.held + chunk if self.held else chunk
        end = max(data.rfind(b"\n\n") + 2, data.rfind(b"\r\n\r\n") + 4)
        if end < 4 and len(data) <= FOLD_AT:  # no event ends in it yet
            self.held = data
            return b""
        if end < 4:
            end = len(data)
        self.held = data[end:]
        out = data[:end] if self.held else data
        self.feed(out)
        return out

    def feed(self, chunk: bytes) -> None:
        """Bytes the client received (kept raw, parsed past :data:`FOLD_AT`)."""
        self.pending.append(chunk)
        self.pending_size += len(chunk)
        if self.pending_size > FOLD_AT:
            self._fold()

    def _fold(self) -> None:
        data = (self.partial + b"".join(self.pending)).replace(b"\r\n", b"\n")
        self.pending, self.pending_size = [], 0
        events = data.split(b"\n\n")
        self.partial = events.pop()
        for event in events:
            self._read_event(event)

    def _read_event(self, event: bytes) -> None:
        payload = _payload(event)
        if payload is None:
            return
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            self.obstacle_seen = self.obstacle_seen or "an event the proxy could not read"
            return
        if not isinstance(obj, dict):
            return
        if "error" in obj:
            self.obstacle_seen = _ENGINE_ERROR
            return
        if self.head is None and "id" in obj:
            self.head = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
        self._count(obj)
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("index", 0) != 0:
                self.obstacle_seen = "several answers were streamed"
            if choice.get("finish_reason") is not None:
                self.finished = True
            piece = choice.get("text")
            delta = choice.get("delta")
            if isinstance(delta, dict):
                piece = delta.get("content")
                if delta.get("tool_calls") or delta.get("function_call"):
                    self.obstacle_seen = "a tool call was streamed"
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    self.obstacle_seen = "reasoning text was streamed"
            if isinstance(piece, str) and piece:
                self.text.append(piece)
                self.text_events += 1

    def _count(self, obj: dict) -> None:
        """The engine's own running count of the tokens generated, where the event says it."""
        usage, timings = obj.get("usage"), obj.get("timings")
        n = None
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            n = usage["completion_tokens"]
        elif isinstance(timings, dict) and isinstance(timings.get("predicted_n"), int):
            n = timings["predicted_n"]
        if n is not None:
            self.counted = max(n, self.counted or 0)

    def ended(self) -> bool:
        """Whether a stream whose engine closed it cleanly had ended: its last bytes are ``[DONE]`` (read from the
        last chunks: no parsing), or its events say it is over (``[DONE]``, or the engine's own error event)."""
        if b"".join(self.pending[-3:]).rstrip().endswith(b"[DONE]"):
            return True
        self.settle()
        return self.done or self.obstacle_seen == _ENGINE_ERROR

    def settle(self) -> None:
        """Parse every complete event sent (the stream broke: what it holds decides what comes next)."""
        self._fold()

    @property
    def tokens_sent(self) -> int:
        return self.counted if self.counted is not None else self.text_events

    def sent_text(self) -> str:
        return "".join(self.text)

    # ------------------------------------------------------------------------------------------ the continuation

    def obstacle(self) -> tuple[str, str] | None:
        """Why this stream cannot be continued (call after :meth:`settle`): ``(reason, what)``, the reason a
        counter's (``options``, ``limit``); None when it can be."""
        if self.continuations >= MAX_CONTINUATIONS:
            return "limit", f"it lost its engine {MAX_CONTINUATIONS + 1} times"
        why = self.obstacle_seen or self._unsound()
        return ("options", why) if why is not None else None

    def _unsound(self) -> str | None:
        """What in the request makes a continuation unsound (the module docstring's list), or None."""
        req = self._request()
        if not isinstance(req, dict):
            return "the request body is not a JSON object"
        for key in ("n", "best_of"):
            if isinstance(req.get(key), int) and req[key] > 1:
                return f"the request asks for {key}={req[key]}"
        for key in ("logprobs", "top_logprobs", "n_probs"):
            if req.get(key) not in (None, False, 0):
                return f"the request asks for {key}"
        fmt = req.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
            return "the request constrains the output (response_format)"
        for key in _CONSTRAINTS:
            if req.get(key) not in (None, "", {}, []):
                return f"the request constrains the output ({key})"
        if self.chat:
            messages = req.get("messages")
            if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
                return "the request has no messages"
            last = messages[-1]
            if last.get("role") == "assistant" and not (
                req.get("continue_final_message") is True and isinstance(last.get("content"), str)
            ):
                return "the request ends with an assistant message"
        else:
            prompt = req.get("prompt")
            if not (
                isinstance(prompt, str)
                or (isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str))
            ):
                return "the prompt is not one text"
        return None

    def ending(self) -> bytes | None:
        """The bytes that end the stream with no engine, when nothing is left to generate: ``[DONE]`` after a
        ``finish_reason`` already sent, a last chunk (``length``) when ``max_tokens`` is used up; else None."""
        if self.done:
            return b""
        if self.obstacle_seen is not None or self._unsound() is not None:
            return None  # several answers, say: one finished is not all
        if self.finished:
            return _DONE
        left = self._tokens_left(self._request())
        if left is not None and left <= 0:
            choice = {"index": 0, "delta": {}} if self.chat else {"index": 0, "text": ""}
            last = dict(self.head or {}, choices=[dict(choice, logprobs=None, finish_reason="length")])
            return b"data: " + json.dumps(last, separators=(",", ":")).encode() + b"\n\n" + _DONE
        return None

    def request_body(self) -> bytes:
        """The continuation request (call after :meth:`obstacle` said None); starts a continuation."""
        req = self._request()
        sent = self.sent_text()
        left = self._tokens_left(req)
        for key in _TOKEN_FIELDS:
            if isinstance(req.get(key), int) and req[key] >= 0:
                req[key] = left
        if self.chat:
            messages = list(req["messages"])
            last = messages[-1]
            if last.get("role") == "assistant":  # the client's own prefill, continued: the text sent follows it
                messages[-1] = dict(last, content=last["content"] + sent)
            else:
                messages.append({"role": "assistant", "content": sent})
            req.update(messages=messages, continue_final_message=True, add_generation_prompt=False)
        else:
            prompt = req["prompt"]
            req["prompt"] = prompt + sent if isinstance(prompt, str) else [prompt[0] + sent]
            req["echo"] = False
        self.continuations += 1
        self.offset = self.tokens_sent
        self.skip_role = self.chat
        self.unread = b""
        return json.dumps(req, separators=(",", ":")).encode()

    def _request(self) -> Any:
        try:
            return json.loads(self.body.data)
        except (ValueError, TypeError):
            return None

    def _tokens_left(self, req: Any) -> int | None:
        if not isinstance(req, dict):
            return None
        limits = [req[k] for k in _TOKEN_FIELDS if isinstance(req.get(k), int) and req[k] >= 0]
        return min(limits) - self.tokens_sent if limits else None

    # ------------------------------------------------------------------------------------------ its events

    def rewrite(self, chunk: bytes) -> bytes:
        """A continuation's bytes as the client's stream says them: complete events rewritten (the rest waits
        for the next chunk); every rewritten event is also recorded as sent (:meth:`feed`)."""
        data = (self.unread + chunk).replace(b"\r\n", b"\n")
        events = data.split(b"\n\n")
        self.unread = events.pop()
        out = []
        for event in events:
            piece = self._rewrite_event(event)
            if piece:
                out.append(piece)
        if not out:
            return b""
        data = b"".join(out)
        self.feed(data)
        return data

    def _rewrite_event(self, event: bytes) -> bytes | None:
        payload = _payload(event)
        if payload is None or payload == b"[DONE]":
            return event + b"\n\n"
        try:
            obj = json.loads(payload)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(obj, dict) or "error" in obj:
            return event + b"\n\n"
        if self.skip_role and self._role_only(obj):
            self.skip_role = False
            return None
        for key, value in (self.head or {}).items():
            if key in obj:
                obj[key] = value
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict):
                delta.pop("role", None)
        usage, timings = obj.get("usage"), obj.get("timings")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            usage["completion_tokens"] += self.offset
            if isinstance(usage.get("prompt_tokens"), int):
                usage["prompt_tokens"] = max(0, usage["prompt_tokens"] - self.offset)
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if isinstance(timings, dict) and isinstance(timings.get("predicted_n"), int):
            timings["predicted_n"] += self.offset
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    @staticmethod
    def _role_only(obj: dict) -> bool:
        """Chat's opening chunk: the role and no text (the client had it from the first engine)."""
        choices = obj.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return False
        delta = choices[0].get("delta")
        return (
            isinstance(delta, dict)
            and "role" in delta
            and not delta.get("content")
            and not delta.get("tool_calls")
            and choices[0].get("finish_reason") is None
        )


def _payload(event: bytes) -> bytes | None:
    """The data of one SSE event (its ``data:`` lines joined), or None when it has none."""
    lines = [ln[5:].lstrip(b" ") for ln in event.strip(b"\r\n").split(b"\n") if ln.startswith(b"data:")]
    return b"\n".join(lines).rstrip(b"\r") if lines else None
