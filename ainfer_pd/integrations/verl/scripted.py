"""Scripted stand-ins for driving verl's agent loop against a random-weight model: a word-level
tokenizer with a chat template, a tool-call parser that "finds" a call in every response, and the
tool it calls. Tests and benchmarks import them: the tiny embedded models produce random tokens,
so a real tokenizer or parser would never see a tool call.

``word_tokenizer(words)``: ids ``t0 .. t{words-1}``, then ``user``, ``assistant``, ``tool``,
``system``. ``scripted_tool(parser, latency_s)`` registers parser ``parser`` with verl (once) and
returns a fresh ``lookup`` tool that answers after ``latency_s``.
"""
from __future__ import annotations

import asyncio


def word_tokenizer(words: int = 508):
    """A word-level fast tokenizer: ``t0 .. t{words-1}`` then the four role words (ids ``words .. words+3``);
    ``t0`` is unknown/pad, ``t1`` EOS; the chat template wraps each message in ``t2 ... t3``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(words)}
    vocab.update({"user": words, "assistant": words + 1, "tool": words + 2, "system": words + 3})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", pad_token="t0", eos_token="t1")
    tok.chat_template = ("{% for m in messages %}t2 {{ m['role'] }} {{ m['content'] }} t3 {% endfor %}"
                         "{% if add_generation_prompt %}t2 assistant {% endif %}")
    return tok


def scripted_tool(parser: str, latency_s: float = 0.0):
    """Register ``parser`` (a verl ``ToolParser`` that reports one ``lookup`` call in every
    response) if it is not registered yet, and return a ``lookup`` tool answering after ``latency_s``."""
    from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
    from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

    if parser not in ToolParser._registry:
        @ToolParser.register(parser)
        class ScriptedParser(ToolParser):
            async def extract_tool_calls(self, responses_ids, tools=None):
                return "t5", [FunctionCall(name="lookup", arguments='{"key": "t9"}')]

    class LookupTool:
        name = "lookup"
        tool_schema = OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
            "name": "lookup", "description": "look a key up",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}})

        async def create(self, create_kwargs=None):
            return "i", None

        async def execute(self, instance_id, args, **kw):
            if latency_s:
                await asyncio.sleep(latency_s)
            return ToolResponse(text=f"{args['key']} t10 t11 t12"), 0.0, {}

        async def release(self, instance_id):
            return None

    return LookupTool()
