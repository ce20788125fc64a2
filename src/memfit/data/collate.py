"""Collation: pad like DataCollatorForSeq2Seq (labels with -100) and count the real tokens training takes."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from memfit.data.packing import Capacity, MicroBatches, pack, sample_lengths

if TYPE_CHECKING:
    from datasets import Dataset

LABEL_PAD = -100  # positions the loss ignores

AUDIT_COLUMNS = ("source_len_raw", "label_len_raw", "label_len_kept")


def model_columns(ds: Dataset) -> Dataset:
    """Only what the model's forward takes (the audit columns are for the length audit alone)."""
    return ds.remove_columns([c for c in AUDIT_COLUMNS if c in ds.column_names])


def loss_positions(labels: Any, task: str) -> Any:
    """How many label positions a batch's loss averages over, as a tensor on the labels' device (read back from no
    GPU): labels not -100, a causal LM's shifted by one as transformers shifts them (its first label predicts
    nothing)."""
    return (labels[:, 1:] if task == "causal" else labels).ne(LABEL_PAD).sum()


class CountingCollator:
    """Pads like DataCollatorForSeq2Seq (labels with -100) and counts the real tokens it hands to training.

    Counting here, on CPU lists before the batch reaches the device, costs no GPU synchronisation.
    """

    def __init__(
        self, tokenizer: Any, pad_to_multiple_of: int | None, task: str = "seq2seq", padding_mask: bool = True
    ):
        from transformers import DataCollatorForSeq2Seq

        self.task, self.pad_to_multiple_of = task, pad_to_multiple_of
        # memory.causal_padding_mask=false: a causal LM's right-padded batch goes without its padding mask. The
        # causal mask alone keeps every real token from the padding after it, so the real tokens' outputs, loss and
        # gradients are the same, and attention takes SDPA's causal kernel instead of a masked one; only the pad
        # positions' own outputs change, which nothing reads. Left padding needs its mask and keeps it.
        right_padded = getattr(tokenizer, "padding_side", "right") == "right"
        self.drops_padding_mask = task == "causal" and not padding_mask and right_padded
        self.count_labels = task == "seq2seq"  # a causal LM's labels are its own input tokens
        # trainer.batching=budget: the batch plan's capacity(source, label); a step's samples are then packed into
        # budget-shaped micro-batches (memfit.data.packing). None: one micro-batch per step, as collated.
        self.capacity: Capacity | None = None
        self.inner = DataCollatorForSeq2Seq(
            tokenizer, label_pad_token_id=LABEL_PAD, pad_to_multiple_of=pad_to_multiple_of, return_tensors="pt"
        )
        self.tokens = 0  # real tokens of the batches training has taken (see consume)
        self.counting = True  # off while Trainer evaluates: eval batches go through the same collator
        self.last_shape: dict[str, tuple[int, ...]] = {}  # the batch training took last: what an OOM hit
        self.seen_shapes: set[tuple] = set()  # padded shapes training has taken: a first sight costs warm-up
        self.new_shapes = 0  # micro-batches whose padded shape training had not taken before
        self.padded_tokens = 0  # tokens with padding of the batches training has taken: what the device computed
        self.micro_batches = 0
        self.rows = 0  # samples of the micro-batches training has taken
        # the label positions the loss of the batch training took last averages over, counted here on the host, so
        # that the loss can pick those rows on the device without reading the labels back (memfit.memory.loss)
        self.last_loss_positions: int | None = None
        # Collated but not yet trained on: the dataloader runs one batch ahead of training (accelerate looks ahead
        # for the end of the data), so counting at collation would count a batch that training never took.
        self._pending: collections.deque = collections.deque()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Collate without counting (evaluation), so tokens are training tokens only."""
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any] | MicroBatches:
        if self.capacity is None:
            return self._collate(features)
        lengths = [sample_lengths(f, self.task) for f in features]
        groups = pack(lengths, self.capacity, self.pad_to_multiple_of)
        return MicroBatches(self._collate([features[i] for i in group]) for group in groups)

    def pad(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        """The padded batch as training takes it, counted or not (the preflight's probes are padded here too)."""
        batch = self.inner(features)
        if self.drops_padding_mask:
            batch.pop("attention_mask", None)
        return batch

    def _collate(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.pad(features)
        if self.counting:
            tokens = sum(len(f["input_ids"]) for f in features)
            padded_tokens = batch["input_ids"].numel()
            if self.count_labels:
                tokens += sum(len(f["labels"]) for f in features)
                padded_tokens += batch["labels"].numel()
            shapes = {k: tuple(v.shape) for k, v in batch.items() if hasattr(v, "shape")}
            positions = int(loss_positions(batch["labels"], self.task)) if "labels" in batch else None
            self._pending.append((tokens, padded_tokens, shapes, len(features), positions))
        return batch

    def consume(self) -> None:
        """Training takes the oldest collated batch (batches are trained in the order they were collated)."""
        self.last_loss_positions = None  # unknown unless the batch was counted here
        if self._pending:
            tokens, padded_tokens, self.last_shape, rows, self.last_loss_positions = self._pending.popleft()
            self.tokens += tokens
            self.rows += rows
            self.padded_tokens += padded_tokens
            self.micro_batches += 1
            shape = tuple(sorted(self.last_shape.items()))
            if shape not in self.seen_shapes:
                self.seen_shapes.add(shape)
                self.new_shapes += 1
