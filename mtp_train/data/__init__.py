"""Conversations in (readers of chat and prompt sets: sources → formats → readers), token ids and assistant-only
loss masks out (spans: where the template puts each assistant turn; chat: tokens and masks)."""

from mtp_train.data.chat import (
    ChatTemplateError,
    TokenizedSample,
    TokenizeStats,
    assistant_char_spans,
    chat_template_fingerprint,
    render,
    tokenize_conversation,
    tokenize_conversations,
    tokenizer_fingerprint,
)
from mtp_train.data.formats import BadRecord, DataError, parse_record
from mtp_train.data.readers import Conversation, ReadStats, iter_conversations, read_conversations

__all__ = [
    "BadRecord",
    "ChatTemplateError",
    "Conversation",
    "DataError",
    "ReadStats",
    "TokenizeStats",
    "TokenizedSample",
    "assistant_char_spans",
    "chat_template_fingerprint",
    "iter_conversations",
    "parse_record",
    "read_conversations",
    "render",
    "tokenize_conversation",
    "tokenize_conversations",
    "tokenizer_fingerprint",
]
