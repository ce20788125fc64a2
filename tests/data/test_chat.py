"""Conversation styles (data.style=messages | prompt_completion | alpaca): rendered with the chat template, trained on
the assistant's tokens only, audited as the model sees them; bad records and templates refused with one line."""

from __future__ import annotations

import re
import shlex

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from memfit.config import ConfigError
from memfit.data import DataError, TokenizeSpec, load_and_tokenize
from memfit.data.chat import CHAT_TEMPLATES, cut_conversation, encode_turns, record_turns
from memfit.data.tokenize import tokenize_split
from memfit.models import build_tokenizer
from memfit.run import run
from memfit.tracking import default_tracking_uri
from tests.conftest import ROOT, run_train_py, write_jsonl

CHATML = CHAT_TEMPLATES["chatml"]
CONVERSATION = [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "What limits the batch size?"},
    {"role": "assistant", "content": "The longest label in the batch."},
    {"role": "user", "content": "And the fix?"},
    {"role": "assistant", "content": "Shape batches by the budget."},
]
# one record of each style, and the turns it stands for
RECORDS = {
    "messages": ({"messages": CONVERSATION}, CONVERSATION),
    "prompt_completion": (
        {"prompt": "Summarise: memory grows with labels.", "completion": "Labels cost memory."},
        [
            {"role": "user", "content": "Summarise: memory grows with labels."},
            {"role": "assistant", "content": "Labels cost memory."},
        ],
    ),
    "alpaca": (
        {"instruction": "Name the knob.", "input": "It cuts labels.", "output": "memory.max_label_length"},
        [
            {"role": "user", "content": "Name the knob.\n\nIt cuts labels."},
            {"role": "assistant", "content": "memory.max_label_length"},
        ],
    ),
}


@pytest.fixture(scope="module")
def tokenizer():
    from omegaconf import OmegaConf

    return build_tokenizer(OmegaConf.create({"tokenizer": None, "name_or_path": None, "source": "random"}))


@pytest.mark.parametrize("style", sorted(RECORDS))
def test_each_style_renders_as_the_chat_template_does_and_trains_on_the_assistant_tokens_only(tokenizer, style):
    record, turns = RECORDS[style]
    assert record_turns(record, style, "r") == turns
    ids, is_label = encode_turns(tokenizer, turns, CHATML)
    direct = tokenizer.apply_chat_template(turns, chat_template=CHATML, tokenize=True)
    assert ids == list(direct["input_ids"] if hasattr(direct, "keys") else direct)
    # the trained tokens are each assistant turn's content and its end marker, in order, and nothing else
    answers = [t["content"] + "<|im_end|>\n" for t in turns if t["role"] == "assistant"]
    expected = [i for text in answers for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    assert [i for i, label in zip(ids, is_label, strict=True) if label] == expected


def test_prompt_and_completion_may_be_lists_of_turns(tokenizer):
    record = {"prompt": CONVERSATION[:2], "completion": [CONVERSATION[2]]}
    assert record_turns(record, "prompt_completion", "r") == CONVERSATION[:3]


def test_tokenized_conversations_mask_everything_but_the_assistant_and_the_audit_sees_the_rendered_lengths(
    tokenizer, compose_cfg, tmp_path
):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 12)
    cfg = compose_cfg(
        "model=tiny_causal", "data=jsonl", f"data.path={path}", "data.style=messages", "data.chat_template=chatml",
        "data.validation_fraction=0", "memory.max_source_length=512", "memory.max_label_length=512",
    )  # fmt: skip
    prepared = load_and_tokenize(cfg, tokenizer)
    row = prepared.datasets["train"][0]
    ids, is_label = encode_turns(tokenizer, CONVERSATION, CHATML)
    assert row["input_ids"] == ids
    assert row["labels"] == [i if label else -100 for i, label in zip(ids, is_label, strict=True)]
    assert np.all(prepared.source_raw + prepared.label_raw == len(ids))  # the rendered sequence, both parts
    assert np.all(prepared.label_raw == sum(is_label))
    assert prepared.audit.label_coverage == 1.0


def test_an_over_long_conversation_keeps_its_start_and_the_audit_counts_the_assistant_tokens_it_loses(tokenizer):
    assert cut_conversation([False, False, True, True, False, True], max_source=2, max_label=5) == 4
    assert cut_conversation([False, True, True, True], max_source=9, max_label=2) == 3
    ids, is_label = encode_turns(tokenizer, CONVERSATION, CHATML)
    first_answer_end = is_label.index(False, is_label.index(True))
    second_answer = is_label.index(True, first_answer_end)
    prompt_before_second = is_label[:second_answer].count(False)
    spec = TokenizeSpec("causal", prompt_before_second - 1, 512, "truncate", "messages", CHATML)
    row = tokenize_split([{"messages": CONVERSATION}], tokenizer, spec)[0]
    assert row["input_ids"] == ids[: second_answer - 1]  # the start, up to the prompt token past max_source
    assert row["label_len_kept"] == first_answer_end - is_label.index(True)  # the first answer, whole
    assert row["label_len_raw"] == sum(is_label) > row["label_len_kept"]  # the second answer is lost: counted
    from memfit.data.audit import audit_lengths, render_table

    source_raw, label_raw = np.array([row["source_len_raw"]]), np.array([row["label_len_raw"]])
    audit = audit_lengths(
        source_raw, label_raw, np.array([True]), task="causal", max_source=spec.max_source_length, max_label=512,
        batch=1, multiple=None, sampler="random", label_kept=np.array([row["label_len_kept"]]),
    )  # fmt: skip
    assert audit.label_coverage == row["label_len_kept"] / row["label_len_raw"]
    assert audit.label_lost_truncate == row["label_len_raw"] - row["label_len_kept"]
    assert audit.label_lost_drop == row["label_len_raw"]  # drop removes the whole conversation
    assert "response tokens that over-long samples lose:" in render_table(audit)


@pytest.mark.parametrize(
    ("record", "said"),
    [
        ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "roles must be"),
        ({"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]}, "no assistant turn"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}]}, "empty assistant"),
    ],
)
def test_a_record_that_a_template_cannot_render_is_refused_with_one_line(record, said):
    with pytest.raises(DataError, match=said) as caught:
        record_turns(record, "messages", "data.path=x.jsonl record 3")
    assert "record 3" in str(caught.value) and "\n" not in str(caught.value)


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    """A template that drops earlier assistant turns (as some "thinking" templates do) gives no prefix to mask by."""
    rewriting = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}|{% endif %}"
        "{% endfor %}"
    )
    with pytest.raises(DataError, match="does not render each assistant turn"):
        encode_turns(tokenizer, CONVERSATION, rewriting)


@pytest.mark.slow
def test_bad_chat_input_stops_with_one_line_before_any_model_load(compose_cfg, tmp_path, caplog):
    """train.py's exit 2 and nothing recorded, for a tokenizer without a template; the other bad inputs raise the
    same one-line errors from the same run() before the model is built (main turns them into exit 2)."""
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 4)
    out = run_train_py(
        "data=jsonl", "model=tiny_causal", f"data.path={chat}", "data.style=messages",
        f"output_dir={tmp_path / 'out'}", "trainer.device=cpu",
    )  # fmt: skip
    lines = [line for line in out.stderr.splitlines() if line.startswith("memfit: error")]
    assert out.returncode == 2 and len(lines) == 1 and "this tokenizer has none" in lines[0], out.stderr[-1500:]
    assert not (tmp_path / "out" / "mlflow.db").exists()  # nothing recorded
    bad_roles = write_jsonl(tmp_path / "roles.jsonl", [{"messages": CONVERSATION[1:2] * 2}])
    cases = [
        (["model=tiny_causal", f"data.path={bad_roles}", "data.style=messages", "data.chat_template=chatml"], "roles"),
        (["model=tiny_seq2seq", f"data.path={chat}", "data.style=messages"], "for a causal LM"),
        (["model=tiny_causal", f"data.path={chat}", "data.style=alpaca"], "needs column 'instruction', 'output'"),
    ]
    for overrides, said in cases:
        with caplog.at_level("INFO"), pytest.raises((ConfigError, DataError)) as caught:
            run(compose_cfg("data=jsonl", *overrides, "trainer.device=cpu"))
        assert len(str(caught.value).splitlines()) == 1 and said in str(caught.value)
        assert "random weights" not in caplog.text  # stopped before the model was built


def _docs_examples() -> list[tuple[str, list[str]]]:
    """docs/data.md's examples: each JSONL block and the command after it."""
    text = (ROOT / "docs" / "data.md").read_text()
    blocks = re.findall(r"```json\n(.*?)```\s*```bash\n(.*?)```", text, flags=re.S)
    return [(rows, shlex.split(command.strip())) for rows, command in blocks]


@pytest.mark.slow
@pytest.mark.parametrize("example", range(3))
def test_the_docs_examples_train_three_steps_on_each_style(compose_cfg, tmp_path, example):
    rows, command = _docs_examples()[example]
    assert command[:2] == ["python", "train.py"]
    overrides = command[2:]
    name = next(o for o in overrides if o.startswith("data.path=")).split("=", 1)[1]
    (tmp_path / name).write_text(rows)
    cfg = compose_cfg(*[f"data.path={tmp_path / name}" if o.startswith("data.path=") else o for o in overrides])
    report = run(cfg)
    assert report.status == "ok" and report.steps == 3
    client = MlflowClient(default_tracking_uri(cfg.output_dir))
    assert len(client.get_metric_history(report.run_id, "train/loss")) == 3
    assert all(m.value > 0 for m in client.get_metric_history(report.run_id, "mem/peak_allocated_gib"))


def test_the_tokenizers_own_template_is_used_unless_data_chat_template_is_set(tokenizer, compose_cfg, tmp_path):
    """A checkpoint's tokenizer with its own template (as Qwen2.5-Instruct's has) needs no data.chat_template."""
    own = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    own += "{% if add_generation_prompt %}<assistant>{% endif %}"
    tokenizer.save_pretrained(tmp_path / "tok")
    (tmp_path / "tok" / "chat_template.jinja").write_text(own)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 4)
    base = ["model=tiny_causal", f"model.tokenizer={tmp_path / 'tok'}", "data=jsonl", f"data.path={path}"]
    cfg = compose_cfg(*base, "data.style=messages", "data.validation_fraction=0")
    with_own = build_tokenizer(cfg.model)
    assert with_own.chat_template == own
    row = load_and_tokenize(cfg, with_own).datasets["train"][0]
    assert row["input_ids"] == encode_turns(with_own, CONVERSATION, own)[0]
    chatml = load_and_tokenize(compose_cfg(*base, "data.style=messages", "data.chat_template=chatml"), with_own)
    assert chatml.datasets["train"][0]["input_ids"] == encode_turns(with_own, CONVERSATION, CHATML)[0]


def test_a_run_says_how_many_conversations_truncation_cut_and_what_they_lose(tokenizer, compose_cfg, tmp_path, caplog):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 3 + [{"messages": CONVERSATION[1:3]}])
    cfg = compose_cfg(
        "model=tiny_causal", "data=jsonl", f"data.path={path}", "data.style=messages", "data.chat_template=chatml",
        "data.validation_fraction=0", "memory.max_source_length=40", "memory.max_label_length=512",
    )  # fmt: skip
    with caplog.at_level("WARNING", logger="memfit"):
        prepared = load_and_tokenize(cfg, tokenizer)
    # the three cut ones kept no assistant token, so they are left out too (the next test)
    lost = int(prepared.label_raw.sum() - np.asarray(prepared.datasets["train"]["label_len_kept"]).sum())
    assert lost > 0 and len(prepared.datasets["train"]) == 1
    assert (
        "3 conversation(s) longer than memory.max_source_length=40 / max_label_length=512 keep their start"
        in (caplog.text)
        and f"{lost} of their assistant tokens are not trained" in caplog.text
    )


def test_a_conversation_cut_before_its_first_assistant_turn_is_left_out_with_a_warning(
    tokenizer, compose_cfg, tmp_path, caplog
):
    """Truncation that keeps a long conversation's start can keep no assistant token: such a sample trains nothing
    (alone in a micro-batch its mean loss is 0 / 0). It is left out with a warning, and a split of nothing else stops
    with one line."""
    long_question = [{"role": "user", "content": "Why? " * 60}, {"role": "assistant", "content": "Labels."}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION[1:3]}] * 3 + [{"messages": long_question}])
    base = ("model=tiny_causal", "data=jsonl", f"data.path={path}", "data.style=messages", "data.chat_template=chatml")
    cfg = compose_cfg(*base, "data.validation_fraction=0", "memory.max_source_length=40")
    with caplog.at_level("WARNING", logger="memfit"):
        prepared = load_and_tokenize(cfg, tokenizer)
    train = prepared.datasets["train"]
    assert len(train) == 3 and all(any(label != -100 for label in row[1:]) for row in train["labels"])
    assert "1 train sample(s) kept no label token" in caplog.text

    only_long = write_jsonl(tmp_path / "long.jsonl", [{"messages": long_question}] * 2)
    cfg = compose_cfg(*base, f"data.path={only_long}", "data.validation_fraction=0", "memory.max_source_length=40")
    with pytest.raises(DataError, match="no training sample kept a label token after truncation"):
        load_and_tokenize(cfg, tokenizer)
