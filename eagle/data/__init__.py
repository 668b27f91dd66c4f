"""Conversation data: readers, chat-template masks, splits, evaluation prompts (self-distillation: `eagle.regenerate`)."""

from eagle.data.dataset import DataSplits, DataStats, build_splits, data_fingerprint, load_conversations
from eagle.data.eval_prompts import EvalPrompt, load_eval_prompts
from eagle.data.records import Conversation
from eagle.data.template import TokenizedConversation, tokenize_conversation

__all__ = [
    "Conversation",
    "DataSplits",
    "DataStats",
    "EvalPrompt",
    "TokenizedConversation",
    "build_splits",
    "data_fingerprint",
    "load_conversations",
    "load_eval_prompts",
    "tokenize_conversation",
]
