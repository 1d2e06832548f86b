"""helexa.model.text: text in and out — tokenizer, chat templates, incremental detokenizer, stop strings."""

from helexa.model.text.chat_template import ChatTemplate, ChatTemplateBroken, ChatTemplateError, validate_messages
from helexa.model.text.detokenizer import IncrementalDetokenizer
from helexa.model.text.stopping import StopChecker, StopResult
from helexa.model.text.tokenizer import Tokenizer

__all__ = [
    "ChatTemplate",
    "ChatTemplateBroken",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "StopChecker",
    "StopResult",
    "Tokenizer",
    "validate_messages",
]
