"""One small formatter per OpenAI API: the response body, or the streamed events, of a finished or running run.

Shapes follow the OpenAI API as the official `openai` client parses them:
- chat: `chat.completion` objects and `chat.completion.chunk` chunks, logprobs as
  `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`;
- completions: `text_completion` objects and chunks, logprobs as
  `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`;
- responses: a `response` object, and the events `response.created`, `response.in_progress`,
  `response.output_item.added`, `response.content_part.added`, `response.output_text.delta`…,
  `response.output_text.done`, `response.content_part.done`, `response.output_item.done`, then
  `response.completed` (with `status: "incomplete"` when `max_output_tokens` cut the text).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from helexa.engine.stream import TokenEvent, TokenLogprob
from helexa.model.text.tokenizer import Tokenizer
from helexa.server.generation import Choice, GenerationRun
from helexa.server.protocol import GenerationRequest, parse_chat, parse_completion, parse_response
from helexa.server.sse import DONE, sse

__all__ = ["FORMATS", "ApiFormat", "LogprobFormatter", "Usage"]


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

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        """The string of one token id."""
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def chat(self, logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """Chat `logprobs.content` entries, one per token."""
        return [
            {**self._entry(lp.token_id, lp.logprob), "top_logprobs": [self._entry(*top) for top in lp.top]}
            for lp in logprobs
        ]

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
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops if want_top else None,
            "text_offset": offsets,
        }


class ApiFormat:
    """How one API shapes a run: `body()` once every choice ended, or `start()`, `event()` per engine
    event and `end(failed)` while streaming (each yields SSE bytes). `failed`: the stream ended on an error
    event (already sent as an error event)."""

    id_prefix: ClassVar[str]

    def __init__(self, req: GenerationRequest, run: GenerationRun, model: str, logprobs: LogprobFormatter) -> None:
        self.req, self.run, self.model, self.logprobs = req, run, model, logprobs
        self.tokenizer = logprobs.tokenizer
        self.created = int(time.time())

    @property
    def usage(self) -> Usage:
        return Usage(self.run.prompt_tokens, self.run.completion_tokens)

    def body(self) -> dict[str, Any]:
        raise NotImplementedError

    def start(self) -> Iterator[bytes]:
        raise NotImplementedError

    def event(self, choice: Choice, event: TokenEvent) -> Iterator[bytes]:
        raise NotImplementedError

    def end(self, failed: bool) -> Iterator[bytes]:
        raise NotImplementedError

    def _object(self, kind: str, choices: list[dict[str, Any]], usage: Usage | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.run.request_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if usage is not None or (self.req.stream and self.req.include_usage):
            body["usage"] = None if usage is None else usage.openai()  # null on every chunk but the last
        return body

    def _usage_end(self, kind: str, failed: bool) -> Iterator[bytes]:
        if self.req.include_usage and not failed:
            yield sse(self._object(kind, [], self.usage))
        yield DONE


class ChatFormat(ApiFormat):
    """`POST /v1/chat/completions`."""

    id_prefix = "chatcmpl-"

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        return None if self.req.logprobs is None else {"content": self.logprobs.chat(logprobs), "refusal": None}

    def body(self) -> dict[str, Any]:
        choices: list[dict[str, Any]] = [
            {
                "index": c.index,
                "finish_reason": c.finish_reason,
                "logprobs": self._logprobs(c.logprobs),
                "message": {"role": "assistant", "content": c.output_text, "refusal": None, "tool_calls": []},
            }
            for c in self.run.choices
        ]
        return self._object("chat.completion", choices, self.usage)

    def _chunk(
        self,
        index: int,
        delta: dict[str, Any],
        logprobs: dict[str, Any] | None = None,
        finish_reason: str | None = None,
    ) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse(self._object("chat.completion.chunk", [choice], None))

    def start(self) -> Iterator[bytes]:
        for choice in self.run.choices:
            yield self._chunk(choice.index, {"role": "assistant", "content": ""})

    def event(self, choice: Choice, event: TokenEvent) -> Iterator[bytes]:
        if event.text or event.finished or event.logprobs:
            yield self._chunk(
                choice.index,
                {"content": event.text} if event.text else {},
                self._logprobs(event.logprobs),
                event.finish_reason,
            )

    def end(self, failed: bool) -> Iterator[bytes]:
        return self._usage_end("chat.completion.chunk", failed)


class CompletionFormat(ApiFormat):
    """`POST /v1/completions` (with `echo`: the prompt text before each choice's output)."""

    id_prefix = "cmpl-"

    def __init__(self, req: GenerationRequest, run: GenerationRun, model: str, logprobs: LogprobFormatter) -> None:
        super().__init__(req, run, model, logprobs)
        self._offsets = {c.index: 0 for c in run.choices}  # text offset of each choice's next token

    def _echo(self, choice: Choice) -> str:
        if not self.req.echo:
            return ""
        prompt = self.req.prompts[choice.index // self.req.n]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def _logprobs(self, logprobs: Sequence[TokenLogprob], offset: int) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        return self.logprobs.completion(logprobs, offset, want_top=self.req.logprobs > 0)

    def body(self) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for c in self.run.choices:
            echo = self._echo(c)
            choices.append(
                {
                    "index": c.index,
                    "text": echo + c.output_text,
                    "finish_reason": c.finish_reason,
                    "logprobs": self._logprobs(c.logprobs, len(echo)),
                }
            )
        return self._object("text_completion", choices, self.usage)

    def _chunk(
        self, index: int, text: str, logprobs: dict[str, Any] | None = None, finish_reason: str | None = None
    ) -> bytes:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse(self._object("text_completion", [choice], None))

    def start(self) -> Iterator[bytes]:
        for choice in self.run.choices:
            if echo := self._echo(choice):
                self._offsets[choice.index] = len(echo)
                yield self._chunk(choice.index, echo)

    def event(self, choice: Choice, event: TokenEvent) -> Iterator[bytes]:
        if event.text or event.finished or event.logprobs:
            logprobs = self._logprobs(event.logprobs, self._offsets[choice.index])
            self._offsets[choice.index] += len(event.text)
            yield self._chunk(choice.index, event.text, logprobs, event.finish_reason)

    def end(self, failed: bool) -> Iterator[bytes]:
        return self._usage_end("text_completion", failed)


class ResponsesFormat(ApiFormat):
    """`POST /v1/responses`: one output message; streamed as numbered events (`sequence_number`)."""

    id_prefix = "resp_"

    def __init__(self, req: GenerationRequest, run: GenerationRun, model: str, logprobs: LogprobFormatter) -> None:
        super().__init__(req, run, model, logprobs)
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self._seq = 0

    def _message(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def _response(self, choice: Choice | None) -> dict[str, Any]:
        """The `response` object: in progress (`choice` None), completed, or incomplete (cut at the limit)."""
        status = "in_progress" if choice is None else "incomplete" if choice.finish_reason == "length" else "completed"
        sampling = self.req.sampling
        return {
            "id": self.run.request_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": self.req.instructions,
            "max_output_tokens": self.req.max_tokens,
            "model": self.model,
            "output": [] if choice is None else [self._message(choice.output_text, status)],
            "parallel_tool_calls": False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": _or(sampling.get("temperature"), 1.0),
            "top_p": _or(sampling.get("top_p"), 1.0),
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "truncation": "disabled",
            "usage": None if choice is None else self.usage.responses(),
            "user": None,
            "metadata": {},
        }

    def _event(self, kind: str, **fields: Any) -> bytes:
        self._seq += 1
        return sse({"type": kind, "sequence_number": self._seq - 1, **fields}, event=kind)

    def body(self) -> dict[str, Any]:
        (choice,) = self.run.choices
        return self._response(choice)

    def start(self) -> Iterator[bytes]:
        response, where = self._response(None), {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        yield self._event("response.created", response=response)
        yield self._event("response.in_progress", response=response)
        yield self._event("response.output_item.added", output_index=0, item=self._message(None, "in_progress"))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        yield self._event("response.content_part.added", **where, part=part)

    def event(self, choice: Choice, event: TokenEvent) -> Iterator[bytes]:
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        if event.text:
            yield self._event("response.output_text.delta", **where, delta=event.text, logprobs=[])
        if event.finished:
            # The last event is `response.completed` even when the text was cut at `max_output_tokens`
            # (the response's status is then "incomplete"): the official client's stream helper requires it.
            text, response = choice.output_text, self._response(choice)
            yield self._event("response.output_text.done", **where, text=text, logprobs=[])
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            yield self._event("response.content_part.done", **where, part=part)
            yield self._event("response.output_item.done", output_index=0, item=response["output"][0])
            yield self._event("response.completed", response=response)

    def end(self, failed: bool) -> Iterator[bytes]:
        return iter(())


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


# Each generation path: how its body is parsed, and how its run is shaped.
FORMATS: dict[str, tuple[Callable[[dict[str, Any]], GenerationRequest], type[ApiFormat]]] = {
    "/v1/chat/completions": (parse_chat, ChatFormat),
    "/v1/completions": (parse_completion, CompletionFormat),
    "/v1/responses": (parse_response, ResponsesFormat),
}
