"""Conversations (data.style=messages | prompt_completion | alpaca): each record becomes a list of {role, content}
turns, rendered with the tokenizer's chat template (or data.chat_template), and only the assistant's tokens are
trained on. The length audit sees what the model sees: its "label" is the assistant tokens, its "source" the rest.

Where each assistant turn starts and ends is read from the template itself: the conversation up to that turn
rendered with `add_generation_prompt=True` must be a prefix of the conversation through that turn, which must be a
prefix of the whole conversation. A template that renders otherwise (for example one that rewrites earlier turns)
is refused with one line, rather than trained with a wrong mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memfit.data.error import DataError

# data.chat_template=chatml: the ChatML layout Qwen2.5 uses, without its default system turn
CHAT_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
        "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
}


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{what} must be text, got {type(value).__name__}")
    return value


def _turns(value: Any, role: str, what: str) -> list[dict[str, str]]:
    """Plain text as one turn of `role`, or a list of {role, content} turns as given."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(f"{what} must be text or a list of {{role, content}} turns")
    return [{"role": str(t.get("role")), "content": _text(t.get("content"), f"{what} content")} for t in value]


def record_turns(record: dict[str, Any], style: str, where: str) -> list[dict[str, str]]:
    """One record of `style` as checked conversation turns; `where` names the record in errors."""
    if style == "messages":
        turns = _turns(record.get("messages"), "user", f"{where} 'messages'")
    elif style == "prompt_completion":
        turns = _turns(record.get("prompt"), "user", f"{where} 'prompt'")
        turns += _turns(record.get("completion"), "assistant", f"{where} 'completion'")
    else:  # alpaca
        instruction = _text(record.get("instruction"), f"{where} 'instruction'")
        extra = record.get("input") or ""
        user = f"{instruction}\n\n{_text(extra, f'{where} input')}" if extra else instruction
        output = _text(record.get("output"), f"{where} 'output'")
        turns = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    check_turns(turns, where)
    return turns


def check_turns(turns: Sequence[dict[str, str]], where: str) -> None:
    """An optional system turn, then user and assistant turns alternating from a user turn; at least one assistant
    turn, none empty: what chat templates require and what has something to train on."""
    roles = [t["role"] for t in turns]
    body = roles[1:] if roles[:1] == ["system"] else roles
    expected = ["user" if i % 2 == 0 else "assistant" for i in range(len(body))]
    if body != expected:
        shown = ", ".join(roles)
        raise DataError(
            f"{where}: roles must be an optional system turn, then user and assistant alternating from user "
            f"(got {shown}): merge or reorder the turns"
        )
    if "assistant" not in roles:
        raise DataError(f"{where} has no assistant turn: nothing to train on; add the response or remove the record")
    if any(t["role"] == "assistant" and not t["content"].strip() for t in turns):
        raise DataError(f"{where} has an empty assistant turn: fill it in or remove the record")


def template_for(tokenizer: Any, chat_template: str | None) -> str:
    """The Jinja template conversations are rendered with: data.chat_template (a built-in's name or Jinja text),
    else the tokenizer's own."""
    if chat_template:
        return CHAT_TEMPLATES.get(chat_template, chat_template)
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: the default one
        own = own.get("default")
    if not own:
        raise DataError(
            "data.style needs a chat template and this tokenizer has none: set data.chat_template=chatml "
            "(or a Jinja template string)"
        )
    return own


def _render(tokenizer: Any, turns: Sequence[dict[str, str]], template: str, prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        list(turns), chat_template=template, tokenize=False, add_generation_prompt=prompt
    )


Spans = list[tuple[int, int]]


def assistant_spans(tokenizer: Any, turns: Sequence[dict[str, str]], template: str) -> tuple[str, Spans]:
    """The rendered conversation and the character spans of its assistant turns (their end markers included)."""
    text = _render(tokenizer, turns, template)
    spans = []
    for index, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        before = _render(tokenizer, turns[:index], template, prompt=True)
        through = _render(tokenizer, turns[: index + 1], template)
        if not (through.startswith(before) and text.startswith(through) and turn["content"] in through[len(before) :]):
            raise DataError(
                "the chat template does not render each assistant turn after its add_generation_prompt prefix, so "
                "memfit cannot find which tokens to train on: set data.chat_template=chatml or a template that does"
            )
        spans.append((len(before), len(through)))
    return text, spans


def encode_turns(tokenizer: Any, turns: Sequence[dict[str, str]], template: str) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation (as apply_chat_template tokenizes it: no added special tokens) and,
    per token, whether it belongs to an assistant turn."""
    text, spans = assistant_spans(tokenizer, turns, template)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = [start for start, _ in encoded["offset_mapping"]]
    return encoded["input_ids"], [any(a <= s < b for a, b in spans) for s in starts]


def cut_conversation(is_label: Sequence[bool], max_source: int, max_label: int) -> int:
    """How many tokens from the start of a conversation to keep: up to the first that would take its non-assistant
    tokens past max_source or its assistant tokens past max_label (memory.overlength=truncate keeps the start)."""
    counts = [0, 0]
    limits = (max_source, max_label)
    for index, label in enumerate(is_label):
        counts[label] += 1
        if counts[label] > limits[label]:
            return index
    return len(is_label)
