"""Function calling for one served model: which format it writes calls in, how a request's conversation
and tools reach its chat template, and the constraints a forced call adds."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from helexa.model.text.tokenizer import Tokenizer
from helexa.model.tools import PARSERS, ToolCallParser, ToolSpecError, detect_format, forced_call_grammar, tool_names
from helexa.model.tools.prompting import prepare_conversation
from helexa.server.errors import APIError
from helexa.server.protocol import GenerationRequest

logger = logging.getLogger("helexa.server")


class ToolCalling:
    """The model's tool-call format (`parser`: `--tool-call-parser`, else detected from its chat template)."""

    def __init__(self, tokenizer: Tokenizer, parser_name: str | None = None) -> None:
        self.tokenizer = tokenizer
        template = tokenizer.template_for(tools=True)
        detected = detect_format(template.source if template is not None else None)
        self.parser: type[ToolCallParser] = PARSERS[parser_name or detected]
        self.native = template is not None and template.uses_tools  # the template shows tools itself
        marker = self.parser.marker
        marker_id = tokenizer.token_to_id(marker) if marker is not None else None
        self.marker_token = marker_id if marker_id in tokenizer.special_token_ids else None
        how = "by its chat template" if self.native else "by helexa in the system prompt (its template has no tools)"
        logger.info(
            "tool calls: %s format (%s); tools are shown %s",
            self.parser.name,
            "set by --tool-call-parser" if parser_name else "detected",
            how,
        )

    def conversation(self, req: GenerationRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools `req`'s prompt renders (tools hidden when `tool_choice` is "none")."""
        assert req.messages is not None
        tools = req.tools if req.tool_choice != "none" else None
        return prepare_conversation(req.messages, tools, self.tokenizer.template_for(bool(tools)), self.parser)

    def constrain(self, req: GenerationRequest) -> GenerationRequest:
        """`req` with what its tools need of decoding: the forced-call grammar for `tool_choice` "required"
        or a named function (it replaces a `response_format` grammar: the forced call wins, and the
        answer has no text for the format to govern); under "auto" beside a format, calls or text in
        the format; and special tokens kept in the text when the format's marker is one. 400 naming
        the tool whose schema cannot be compiled."""
        if req.tool_choice == "none" or req.tools is None:
            return req
        changes: dict[str, Any] = {}
        if self.parser.keeps_special_tokens and "skip_special_tokens" not in req.sampling:
            changes["sampling"] = {**req.sampling, "skip_special_tokens": False}
        forced = req.tool_choice == "required"
        if forced or req.format_schema is not None:
            # A named function is called exactly once (as OpenAI and vLLM do); otherwise an answer may make
            # several calls unless `parallel_tool_calls` is false, and ends at a repeated one (`parser_for`).
            parallel = req.parallel_tool_calls and req.tool_name is None
            or_text = None if forced else req.format_schema
            try:
                changes["grammar"] = forced_call_grammar(
                    req.tools, self.parser, req.tool_name, parallel, self.marker_token, or_text
                )
            except ToolSpecError as exc:
                raise APIError("invalid_request", str(exc), param=exc.param) from None
        return dataclasses.replace(req, **changes) if changes else req

    def parser_for(self, req: GenerationRequest) -> ToolCallParser | None:
        """A fresh parser for one choice of `req`, or None when its output is plain text. It ends the answer
        at the first repeat of an identical call (`distinct`: a repeat is never useful, and a small model
        may otherwise loop until `max_tokens`, forced or not), and with `parallel_tool_calls` false at a
        second call (`single`, as OpenAI applies it to "auto" too): that call and all after it are dropped."""
        if req.tool_choice == "none" or req.tools is None:
            return None
        return self.parser(tool_names(req.tools), distinct=True, single=not req.parallel_tool_calls)
