"""One formatter per OpenAI API (chat, completions, responses): the body of a finished run, or the
streamed events of a running one, shaped as the official `openai` client parses them (objects and event
order: docs/reference.md, "Responses and streaming")."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

from helexa.engine.stream import TokenEvent, TokenLogprob
from helexa.model.text.tokenizer import Tokenizer
from helexa.model.tools import Item, ToolCall, ToolCallParser, parse_all
from helexa.server.generation import Choice, GenerationRun
from helexa.server.protocol import GenerationRequest, parse_chat, parse_completion, parse_response
from helexa.server.sse import DONE, TextEvents, sse

# The logprob written for a token the model gives no probability at all (vLLM writes the same): the wire
# carries strict JSON, which has no -Infinity.
LOGPROB_FLOOR = -9999.0


def wire_logprob(value: float) -> float:
    """`value` as it may go on the wire: finite, at least `LOGPROB_FLOOR` (NaN becomes the floor)."""
    return value if value >= LOGPROB_FLOOR and math.isfinite(value) else LOGPROB_FLOOR


class LogprobFormatter:
    """Token ids → the token strings OpenAI logprobs show (each id decoded alone, special tokens kept).

    A byte-level token holding part of a multi-byte character decodes to U+FFFD, as OpenAI's
    `token` does; `bytes` carries the UTF-8 of that string. Strings are cached per id. Every logprob
    passes `wire_logprob` (the sampler's are finite already: taken before any grammar mask).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.token(token_id)
        return {"token": token, "logprob": wire_logprob(logprob), "bytes": list(token.encode())}

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
            values.append(wire_logprob(lp.logprob))
            offsets.append(offset)
            offset += len(token)
            if want_top:
                top: dict[str, float] = {}
                for tid, value in lp.top:
                    top.setdefault(self.token(tid), wire_logprob(value))  # distinct ids may share a string
                tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops if want_top else None,
            "text_offset": offsets,
        }


class ApiFormat:
    """How one API shapes a run: `body()` once every choice ended; while streaming, `start()`, `event()`
    per engine event and `end(failed)` (`failed`: the stream ended on an error event, already sent), each
    yielding SSE bytes. Chat and completions share the chunk, usage and `[DONE]` framing here."""

    id_prefix: ClassVar[str]
    body_object: ClassVar[str]
    chunk_object: ClassVar[str]

    def __init__(self, req: GenerationRequest, run: GenerationRun, model: str, logprobs: LogprobFormatter) -> None:
        self.req, self.run, self.model, self.logprobs = req, run, model, logprobs
        self.created = int(time.time())
        self._new_parser = run.new_parser  # a fresh tool-call parser per choice (None: the output is plain text)
        self._parsers: dict[int, ToolCallParser | None] = {}
        self._text_events: dict[int, TextEvents] = {}  # per choice: its text chunks, rendered once

    def _items(self, choice: Choice, event: TokenEvent) -> list[Item]:
        """The output items `event` completes for `choice`: its text, or (with tools) text and calls."""
        if choice.index not in self._parsers:
            self._parsers[choice.index] = self._new_parser()
        parser = self._parsers[choice.index]
        if parser is None:
            return [event.text] if event.text else []
        return [*parser.feed(event.text), *(parser.finish() if event.finished else ())]

    def _whole(self, choice: Choice) -> tuple[str | None, list[ToolCall]]:
        """A finished choice's (content, calls); content None only when there are calls and no text."""
        parser = self._new_parser()
        if parser is None:
            return choice.output_text, []
        content, calls = parse_all(parser, choice.output_text)
        return (content if content is not None or calls else ""), calls

    @staticmethod
    def _finish_reason(choice: Choice, made_call: bool) -> str | None:
        return "tool_calls" if made_call and choice.finish_reason == "stop" else choice.finish_reason

    def body(self) -> dict[str, Any]:
        raise NotImplementedError

    def start(self) -> Iterator[bytes]:
        raise NotImplementedError

    def event(self, choice: Choice, event: TokenEvent) -> Iterator[bytes]:
        raise NotImplementedError

    def _usage(self) -> dict[str, Any]:
        """Token counts (the prompt counted once, even with several choices)."""
        prompt, completion = self.run.prompt_tokens, self.run.completion_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.run.cached_tokens},
        }

    def _object(self, kind: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.run.request_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if usage is not None or (self.req.stream and self.req.include_usage):
            body["usage"] = usage  # null on every chunk but the last (unless continuous_usage)
        return body

    def _chunk(
        self, index: int, logprobs: dict[str, Any] | None = None, finish_reason: str | None = None, **content: Any
    ) -> bytes:
        """One choice's chunk; with `continuous_usage` (vLLM's `continuous_usage_stats`) it carries the usage
        so far, else `usage` is null (when usage was asked for at all)."""
        choice = {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}
        usage = self._usage() if self.req.continuous_usage else None
        return sse(self._object(self.chunk_object, [choice], usage))

    def _text_content(self, text: str) -> dict[str, Any]:
        """The fields of a chunk that carries only `text` (chat: a delta's content; completions: `text`)."""
        raise NotImplementedError

    def _text_chunk(self, index: int, text: str) -> bytes:
        """`_chunk(index, **_text_content(text))` (no logprobs, no finish reason): from the choice's text chunk
        rendered once (`TextEvents`), the same bytes without encoding the whole chunk for each token; rendered
        whole when each chunk carries the usage so far."""
        if self.req.continuous_usage:
            return self._chunk(index, **self._text_content(text))
        events = self._text_events.get(index)
        if events is None:
            events = self._text_events[index] = TextEvents(lambda t: self._chunk(index, **self._text_content(t)))
        return events(text)

    def end(self, failed: bool) -> Iterator[bytes]:
        if self.req.include_usage and not failed:
            yield sse(self._object(self.chunk_object, [], self._usage()))
        yield DONE


class ChatFormat(ApiFormat):
    """`POST /v1/chat/completions`."""

    id_prefix, body_object, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._calls: dict[int, int] = {}  # tool calls streamed so far, per choice

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        return None if self.req.logprobs is None else {"content": self.logprobs.chat(logprobs), "refusal": None}

    def body(self) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for c in self.run.choices:
            content, calls = self._whole(c)
            message = {
                "role": "assistant",
                "content": content,
                "refusal": None,
                "tool_calls": [t.openai() for t in calls],
            }
            choices.append(
                {
                    "index": c.index,
                    "finish_reason": self._finish_reason(c, bool(calls)),
                    "logprobs": self._logprobs(c.logprobs),
                    "message": message,
                }
            )
        return self._object(self.body_object, choices, self._usage())

    def start(self) -> Iterator[bytes]:
        for choice in self.run.choices:
            yield self._chunk(choice.index, delta={"role": "assistant", "content": ""})

    def _text_content(self, text: str) -> dict[str, Any]:
        return {"delta": {"content": text}}

    def event(self, choice: Choice, event: TokenEvent) -> Iterator[bytes]:
        logprobs = self._logprobs(event.logprobs) if event.logprobs else None
        calls = self._calls.setdefault(choice.index, 0)
        for item in self._items(choice, event):
            if isinstance(item, str):
                if logprobs is None:  # most chunks: text alone
                    yield self._text_chunk(choice.index, item)
                    continue
                delta: dict[str, Any] = {"content": item}
            else:
                delta, calls = {"tool_calls": [item.openai(index=calls)]}, calls + 1
            yield self._chunk(choice.index, logprobs, delta=delta)
            logprobs = None  # sent with the first chunk of this event
        self._calls[choice.index] = calls
        if event.finished or logprobs is not None:
            reason = self._finish_reason(choice, calls > 0) if event.finished else None
            yield self._chunk(choice.index, logprobs, reason, delta={})


class CompletionFormat(ApiFormat):
    """`POST /v1/completions` (with `echo`: the prompt text before each choice's output)."""

    id_prefix, body_object, chunk_object = "cmpl-", "text_completion", "text_completion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._offsets = {c.index: 0 for c in self.run.choices}  # text offset of each choice's next token

    def _echo(self, choice: Choice) -> str:
        if not self.req.echo:
            return ""
        prompt = self.req.prompts[choice.index // self.req.n]
        return prompt if isinstance(prompt, str) else self.logprobs.tokenizer.decode(prompt)

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
        return self._object(self.body_object, choices, self._usage())

    def start(self) -> Iterator[bytes]:
        for choice in self.run.choices:
            if echo := self._echo(choice):
                self._offsets[choice.index] = len(echo)
                yield self._chunk(choice.index, text=echo)

    def _text_content(self, text: str) -> dict[str, Any]:
        return {"text": text}

    def event(self, choice: Choice, event: TokenEvent) -> Iterator[bytes]:
        if event.text or event.finished or event.logprobs:
            logprobs = self._logprobs(event.logprobs, self._offsets[choice.index])
            self._offsets[choice.index] += len(event.text)
            if logprobs is None and event.finish_reason is None:  # most chunks: text alone
                yield self._text_chunk(choice.index, event.text)
            else:
                yield self._chunk(choice.index, logprobs, event.finish_reason, text=event.text)


class ResponsesFormat(ApiFormat):
    """`POST /v1/responses`: output items (messages, and function calls when tools are on), streamed as
    numbered events (`sequence_number`). A message item opens with the first text after a call or at the
    start, so a text-only answer is one message, as before; an answer with no text at all still has one
    (empty) message unless it made calls."""

    id_prefix = "resp_"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._seq = 0
        self._output: list[dict[str, Any]] = []  # the output items so far
        self._open: dict[str, Any] | None = None  # the message item text is going into

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _response(self, choice: Choice | None) -> dict[str, Any]:
        """The `response` object: in progress (`choice` None), completed, or incomplete (cut at the limit)."""
        status = "in_progress" if choice is None else "incomplete" if choice.finish_reason == "length" else "completed"
        prompt, completion = self.run.prompt_tokens, self.run.completion_tokens
        usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": self.run.cached_tokens},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        }
        choice_shown: Any = self.req.tool_choice
        if self.req.tool_name is not None:
            choice_shown = {"type": "function", "name": self.req.tool_name}
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
            "output": [] if choice is None else self._output,
            "parallel_tool_calls": self.req.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": self.run.sampling.get("temperature", 1.0),
            "top_p": self.run.sampling.get("top_p", 1.0),
            "text": {"format": self.req.text_format or {"type": "text"}},
            "tool_choice": choice_shown,
            "tools": [{"type": "function", **t["function"]} for t in self.req.tools or ()],
            "truncation": "disabled",
            "usage": None if choice is None else usage,
            "user": None,
            "metadata": {},
        }

    def _event(self, kind: str, **fields: Any) -> bytes:
        self._seq += 1
        return sse({"type": kind, "sequence_number": self._seq - 1, **fields}, event=kind)

    def _open_message(self) -> Iterator[bytes]:
        self._open = {
            "type": "message",
            "id": f"msg_{uuid.uuid4().hex}",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self._output.append(self._open)
        where = {"item_id": self._open["id"], "output_index": len(self._output) - 1}
        yield self._event("response.output_item.added", output_index=where["output_index"], item=dict(self._open))
        yield self._event("response.content_part.added", **where, content_index=0, part=self._part(""))
        self._open["content"] = [self._part("")]

    def _close_message(self, status: str) -> Iterator[bytes]:
        message, self._open = self._open, None
        if message is None:
            return
        index = self._output.index(message)
        part, where = message["content"][0], {"item_id": message["id"], "output_index": index, "content_index": 0}
        message["status"] = status
        yield self._event("response.output_text.done", **where, text=part["text"], logprobs=[])
        yield self._event("response.content_part.done", **where, part=part)
        yield self._event("response.output_item.done", output_index=index, item=message)

    def _add(self, item: Item) -> Iterator[bytes]:
        """Fold one output item in, yielding the events that announce it."""
        if isinstance(item, str):
            if self._open is None:
                yield from self._open_message()
            assert self._open is not None
            self._open["content"][0]["text"] += item
            where = {"item_id": self._open["id"], "output_index": len(self._output) - 1, "content_index": 0}
            yield self._event("response.output_text.delta", **where, delta=item, logprobs=[])
            return
        yield from self._close_message("completed")
        call = {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex}",
            "call_id": item.id,
            "name": item.name,
            "arguments": "",
            "status": "in_progress",
        }
        index = len(self._output)
        self._output.append(call)
        yield self._event("response.output_item.added", output_index=index, item=dict(call))
        where = {"item_id": call["id"], "output_index": index}
        yield self._event("response.function_call_arguments.delta", **where, delta=item.arguments)
        call.update(arguments=item.arguments, status="completed")
        yield self._event("response.function_call_arguments.done", **where, name=item.name, arguments=item.arguments)
        yield self._event("response.output_item.done", output_index=index, item=call)

    def _end(self, choice: Choice) -> Iterator[bytes]:
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        if not self._output:  # no text and no call: one empty message, as a text answer would have
            yield from self._open_message()
        yield from self._close_message(status)

    def body(self) -> dict[str, Any]:
        (choice,) = self.run.choices
        parser = self._new_parser()
        items = [choice.output_text] if parser is None else [*parser.feed(choice.output_text), *parser.finish()]
        for item in items:
            for _ in self._add(item):
                pass
        for _ in self._end(choice):
            pass
        return self._response(choice)

    def start(self) -> Iterator[bytes]:
        response = self._response(None)
        yield self._event("response.created", response=response)
        yield self._event("response.in_progress", response=response)
        if self._new_parser() is None:  # plain text: the message opens at once, as OpenAI's does
            yield from self._open_message()

    def event(self, choice: Choice, event: TokenEvent) -> Iterator[bytes]:
        for item in self._items(choice, event):
            yield from self._add(item)
        if event.finished:
            # As OpenAI's: `response.incomplete` when the answer was cut at `max_output_tokens`, else
            # `response.completed`. (The openai client reads either; only its `get_final_response()`
            # helper insists on `response.completed`, against OpenAI as here.)
            yield from self._end(choice)
            response = self._response(choice)
            yield self._event(f"response.{response['status']}", response=response)

    def end(self, failed: bool) -> Iterator[bytes]:
        return iter(())


# Each generation path: how its body is parsed (the second argument: `--allow-additional-properties`), and
# how its run is shaped.
FORMATS: dict[str, tuple[Callable[[dict[str, Any], bool], GenerationRequest], type[ApiFormat]]] = {
    "/v1/chat/completions": (parse_chat, ChatFormat),
    "/v1/completions": (parse_completion, CompletionFormat),
    "/v1/responses": (parse_response, ResponsesFormat),
}
# The generation paths with a `/render` twin (vLLM's): the prompt's token ids without generating.
RENDERED = ("/v1/chat/completions", "/v1/completions")
