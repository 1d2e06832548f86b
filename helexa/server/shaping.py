"""OpenAI response bodies and streaming chunks (pure functions, no engine).

Shapes follow the OpenAI API as the official `openai` client parses them:
- chat: `chat.completion` objects and `chat.completion.chunk` chunks, logprobs as
  `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`;
- completions: `text_completion` objects and chunks, logprobs as
  `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`;
- responses: a `response` object, and the event sequence `response.created`, `response.in_progress`,
  `response.output_item.added`, `response.content_part.added`, `response.output_text.delta`…,
  `response.output_text.done`, `response.content_part.done`, `response.output_item.done`, then
  `response.completed` (carrying `status: "incomplete"` when `max_output_tokens` cut the text).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from helexa.engine.stream import TokenLogprob
from helexa.server.sse import sse

__all__ = [
    "LogprobFormatter",
    "ResponseEvents",
    "Usage",
    "chat_chunk",
    "chat_completion",
    "completion",
    "completion_chunk",
    "response_object",
]

@dataclass(frozen=True)
class Usage:
    """Token counts of one request (the prompt counted once, even with several choices)."""

    prompt_tokens: int
    completion_tokens: int

    def openai(self) -> dict[str, int]:
        """Chat and completions `usage`."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def responses(self) -> dict[str, Any]:
        """The Responses API's `usage`."""
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": self.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


class LogprobFormatter:
    """Token ids → the token strings OpenAI logprobs show (each id decoded alone, special tokens kept).

    A byte-level token holding part of a multi-byte character decodes to U+FFFD, as OpenAI's
    `token` does; `bytes` carries the UTF-8 of that string. Strings are cached per id.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        """The string of one token id."""
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text

    def chat(self, logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """Chat `logprobs.content` entries, one per token."""
        out = []
        for lp in logprobs:
            token = self.token(lp.token_id)
            top = [self._chat_top(tid, value) for tid, value in lp.top]
            out.append({"token": token, "logprob": lp.logprob, "bytes": list(token.encode()), "top_logprobs": top})
        return out

    def _chat_top(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def completion(self, logprobs: Sequence[TokenLogprob], text_offset: int, want_top: bool) -> dict[str, Any]:
        """Completions `logprobs` for consecutive tokens whose text starts at `text_offset`."""
        tokens, values, tops, offsets = [], [], [], []
        offset = text_offset
        for lp in logprobs:
            token = self.token(lp.token_id)
            tokens.append(token)
            values.append(lp.logprob)
            offsets.append(offset)
            offset += len(token)
            if want_top:
                top: dict[str, float] = {}
                for tid, value in lp.top:
                    top.setdefault(self.token(tid), value)  # distinct ids may share a string
                tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops if want_top else None,
                "text_offset": offsets}


# --------------------------------------------------------------------------- chat completions


def chat_completion(
    request_id: str, created: int, model: str, choices: Sequence[dict[str, Any]], usage: Usage
) -> dict[str, Any]:
    """A `chat.completion` object. Each of `choices`: `index`, `text`, `finish_reason`, `logprobs` (entries or None)."""
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": c["index"],
                "message": {"role": "assistant", "content": c["text"], "refusal": None, "tool_calls": []},
                "logprobs": None if c["logprobs"] is None else {"content": c["logprobs"], "refusal": None},
                "finish_reason": c["finish_reason"],
            }
            for c in choices
        ],
        "usage": usage.openai(),
    }


def chat_chunk(
    request_id: str,
    created: int,
    model: str,
    index: int | None,
    *,
    delta: dict[str, Any] | None = None,
    logprobs: list[dict[str, Any]] | None = None,
    finish_reason: str | None = None,
    usage: Usage | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    """A `chat.completion.chunk`: one choice's `delta` (or, with `index=None`, the usage-only final chunk).

    With `include_usage`, every chunk carries `"usage": null` except the final one, as OpenAI sends.
    """
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [],
    }
    if index is not None:
        chunk["choices"].append({
            "index": index,
            "delta": delta or {},
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
            "finish_reason": finish_reason,
        })
    if include_usage or usage is not None:
        chunk["usage"] = None if usage is None else usage.openai()
    return chunk


# --------------------------------------------------------------------------- completions


def completion(
    request_id: str, created: int, model: str, choices: Sequence[dict[str, Any]], usage: Usage
) -> dict[str, Any]:
    """A `text_completion` object. Each of `choices`: `index`, `text`, `finish_reason`, `logprobs` (object or None)."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {"index": c["index"], "text": c["text"], "logprobs": c["logprobs"], "finish_reason": c["finish_reason"]}
            for c in choices
        ],
        "usage": usage.openai(),
    }


def completion_chunk(
    request_id: str,
    created: int,
    model: str,
    index: int | None,
    *,
    text: str = "",
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    usage: Usage | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    """A streamed `text_completion` chunk for one choice (or, with `index=None`, the usage-only final chunk)."""
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [],
    }
    if index is not None:
        chunk["choices"].append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})
    if include_usage or usage is not None:
        chunk["usage"] = None if usage is None else usage.openai()
    return chunk


# --------------------------------------------------------------------------- responses


def _message_item(message_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": message_id, "status": status, "role": "assistant", "content": content}


def response_object(
    response_id: str,
    created: int,
    model: str,
    *,
    message_id: str,
    text: str | None,
    status: str,
    usage: Usage | None,
    instructions: str | None,
    max_output_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
) -> dict[str, Any]:
    """A Responses API `response` object.

    `status`: "in_progress" (no output yet: `text=None`), "completed", or "incomplete" (the text was cut
    at `max_output_tokens`; `incomplete_details.reason` says so).
    """
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": instructions,
        "max_output_tokens": max_output_tokens,
        "model": model,
        "output": [] if text is None else [_message_item(message_id, text, "completed" if status == "completed"
                                                         else "incomplete")],
        "parallel_tool_calls": False,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "temperature": 1.0 if temperature is None else temperature,
        "top_p": 1.0 if top_p is None else top_p,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "truncation": "disabled",
        "usage": None if usage is None else usage.responses(),
        "user": None,
        "metadata": {},
    }


class ResponseEvents:
    """The Responses API's streaming events for one response, numbered in order (`sequence_number`).

    Call `start(response)` once, `delta(text)` for each piece, then `finish(text, response)` with the
    final `response` object. Each returns the SSE bytes to send.
    """

    def __init__(self, message_id: str) -> None:
        self.message_id = message_id
        self._seq = 0

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse(data, event=kind)

    def start(self, response: dict[str, Any]) -> bytes:
        """`response.created`, `response.in_progress`, `response.output_item.added`, `response.content_part.added`."""
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return b"".join([
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
            self._event("response.output_item.added", output_index=0,
                        item=_message_item(self.message_id, None, "in_progress")),
            self._event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                        part=part),
        ])

    def delta(self, text: str) -> bytes:
        """One `response.output_text.delta`."""
        return self._event("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                           delta=text, logprobs=[])

    def finish(self, text: str, response: dict[str, Any]) -> bytes:
        """`response.output_text.done` … `response.completed`.

        The last event is `response.completed` even when the text was cut at `max_output_tokens` (the
        response's `status` is then "incomplete"): the official client's stream helper requires it.
        """
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return b"".join([
            self._event("response.output_text.done", item_id=self.message_id, output_index=0, content_index=0,
                        text=text, logprobs=[]),
            self._event("response.content_part.done", item_id=self.message_id, output_index=0, content_index=0,
                        part=part),
            self._event("response.output_item.done", output_index=0, item=response["output"][0]),
            self._event("response.completed", response=response),
        ])
