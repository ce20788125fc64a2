"""Length audit: what the data's token lengths are, what truncation and dropping do to them, and the largest
padded batch the data pipeline can produce. A value computed from tokenized lengths alone (no model), so the
preflight, the sweeper and tests can reason about it cheaply.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class LengthStats:
    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: int

    @classmethod
    def of(cls, lengths: np.ndarray) -> LengthStats:
        if len(lengths) == 0:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0)
        p = np.percentile(lengths, PERCENTILES)
        return cls(len(lengths), float(lengths.mean()), *map(float, p), int(lengths.max()))


@dataclass(frozen=True)
class BatchShape:
    """A padded batch: rows × source positions × label positions (causal: input = label positions)."""

    batch: int
    source: int
    label: int

    @property
    def tokens(self) -> int:
        return self.batch * (self.source + self.label)

    def describe(self, task: str) -> str:
        if task == "causal":
            return f"batch {self.batch} × {self.source} tokens (prompt+response)"
        return f"batch {self.batch} × source {self.source} × labels {self.label}"


def padded(length: int, multiple: int | None) -> int:
    """The length the collator pads to: the batch's longest, rounded up to pad_to_multiple_of."""
    return int(math.ceil(length / multiple) * multiple) if multiple else int(length)


@dataclass
class LengthAudit:
    task: str
    max_source_length: int
    max_label_length: int
    source_raw: LengthStats
    label_raw: LengthStats
    source_kept: LengthStats
    label_kept: LengthStats
    truncated_source: int  # samples whose source the max length cut
    truncated_label: int  # samples whose label the max length cut
    dropped: int  # samples the over-length policy removed
    label_coverage: float  # share of raw label tokens that training sees
    source_coverage: float = 1.0  # share of raw source (prompt) tokens that training sees
    label_lost_truncate: int = 0  # label tokens over-long samples lose under memory.overlength=truncate
    label_lost_drop: int = 0  # label tokens of the samples memory.overlength=drop removes
    over_long: int = 0  # samples longer than either max length (what truncate cuts, or drop removes)
    worst_train: list[BatchShape] = field(default_factory=list)  # the candidates a preflight must probe
    worst_eval: BatchShape | None = None
    sampler: str = "random"
    # the shape bounding every batch of two or more rows (longest source and longest label together), whatever
    # the configured batch: a largest-batch search probes it at each batch above 1
    worst_of_rows: BatchShape | None = None

    def worst_at(self, batch: int) -> BatchShape:
        """The padded shape that bounds every training batch of `batch` rows: at one row the largest single
        sample, at more the longest source and the longest label together."""
        if batch >= 2 and self.worst_of_rows is not None:
            return BatchShape(batch, self.worst_of_rows.source, self.worst_of_rows.label)
        worst = max(self.worst_train, key=lambda s: s.tokens)
        return BatchShape(batch, worst.source, worst.label)

    def metrics(self) -> dict[str, float]:
        """Flat numbers for MLflow (audit/...)."""
        out: dict[str, float] = {}
        for name in ("source_raw", "label_raw", "source_kept", "label_kept"):
            for key, value in asdict(getattr(self, name)).items():
                out[f"audit/{name}_{key}"] = float(value)
        out.update(
            {
                "audit/truncated_source": self.truncated_source,
                "audit/truncated_label": self.truncated_label,
                "audit/dropped": self.dropped,
                "audit/label_coverage": self.label_coverage,
                "audit/source_coverage": self.source_coverage,
                "audit/label_lost_truncate": self.label_lost_truncate,
                "audit/label_lost_drop": self.label_lost_drop,
            }
        )
        worst = max(self.worst_train, key=lambda s: s.tokens)
        out.update(
            {"audit/worst_batch": worst.batch, "audit/worst_source": worst.source, "audit/worst_label": worst.label}
        )
        return out


def label_coverage(label_raw: np.ndarray, max_label: int) -> float:
    """Share of tokens kept when sequences of these raw lengths are cut to max_label (labels or sources)."""
    total = label_raw.sum()
    return float(np.minimum(label_raw, max_label).sum() / total) if total else 1.0


def worst_batches(
    source: np.ndarray, label: np.ndarray, batch: int, task: str, multiple: int | None
) -> list[BatchShape]:
    """The padded batch shapes that bound every batch the sampler can draw.

    Random and length-grouped samplers can put any samples in one batch, and the collator pads the source and
    the labels of a batch each to their own longest. With two or more rows the worst batch therefore holds the
    longest source and the longest label together: one shape. With one row a batch is one sample, and the
    candidates are the samples not dominated in both lengths (at most the longest source, the longest label and
    the longest in total).
    """
    if len(source) == 0:
        return []
    if task == "causal":
        total = source + label
        return [BatchShape(batch, padded(int(total.max()), multiple), padded(int(total.max()), multiple))]
    if batch >= 2:
        return [BatchShape(batch, padded(int(source.max()), multiple), padded(int(label.max()), multiple))]
    picks = {int(source.argmax()), int(label.argmax()), int((source + label).argmax())}
    shapes = {BatchShape(1, padded(int(source[i]), multiple), padded(int(label[i]), multiple)) for i in picks}
    return sorted(shapes, key=lambda s: (-s.tokens, -s.label))


def audit_lengths(
    source_raw: np.ndarray,
    label_raw: np.ndarray,
    kept: np.ndarray,
    *,
    task: str,
    max_source: int,
    max_label: int,
    batch: int,
    multiple: int | None,
    sampler: str,
    eval_lengths: tuple[np.ndarray, np.ndarray] | None = None,
    eval_batch: int | None = None,
    label_kept: np.ndarray | None = None,
) -> LengthAudit:
    """The audit of one training split (raw lengths of every sample, and which samples the policy kept).
    `label_kept`: the label tokens each sample keeps, where cutting is not per part (a conversation keeps its
    start, so a long prompt can take the assistant tokens after it); else the raw lengths cut to max_label."""
    source_cut = np.minimum(source_raw, max_source)[kept]
    labels_cut = np.minimum(label_raw, max_label)
    label_cut = labels_cut[kept]
    truncated = labels_cut if label_kept is None else label_kept
    over = (source_raw > max_source) | (label_raw > max_label)
    total_label = label_raw.sum()
    worst_eval = None
    if eval_lengths is not None and len(eval_lengths[0]):
        ev_src, ev_lab = (np.minimum(eval_lengths[0], max_source), np.minimum(eval_lengths[1], max_label))
        worst_eval = worst_batches(ev_src, ev_lab, max(2, eval_batch or batch), task, multiple)[0]
        worst_eval = BatchShape(min(eval_batch or batch, len(ev_src)), worst_eval.source, worst_eval.label)
    return LengthAudit(
        task=task,
        max_source_length=max_source,
        max_label_length=max_label,
        source_raw=LengthStats.of(source_raw),
        label_raw=LengthStats.of(label_raw),
        source_kept=LengthStats.of(source_cut),
        label_kept=LengthStats.of(label_cut),
        truncated_source=int(((source_raw > max_source) & kept).sum()),
        truncated_label=int(((label_raw > max_label) & kept).sum()),
        dropped=int((~kept).sum()),
        label_coverage=float(truncated[kept].sum() / total_label) if total_label else 1.0,
        source_coverage=float(source_cut.sum() / source_raw.sum()) if source_raw.sum() else 1.0,
        label_lost_truncate=int(total_label - truncated.sum()),
        label_lost_drop=int(label_raw[over].sum()),
        over_long=int(over.sum()),
        worst_train=worst_batches(source_cut, label_cut, batch, task, multiple),
        worst_eval=worst_eval,
        sampler=sampler,
        worst_of_rows=next(iter(worst_batches(source_cut, label_cut, 2, task, multiple)), None),
    )


def render_table(audit: LengthAudit) -> str:
    """A compact text table of the audit, for the console and the log."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    source_name = "prompt" if audit.task == "causal" else "source"
    label_name = "response" if audit.task == "causal" else "labels"
    table = Table(title=f"length audit ({audit.source_raw.count} training samples, tokens)", title_justify="left")
    for column in ("", "mean", "p50", "p90", "p95", "p99", "max", "max len", "cut", "dropped"):
        table.add_column(column, justify="right")
    rows = [
        (source_name, audit.source_raw, audit.max_source_length, audit.truncated_source),
        (label_name, audit.label_raw, audit.max_label_length, audit.truncated_label),
    ]
    for name, stats, limit, cut in rows:
        table.add_row(
            name,
            f"{stats.mean:.0f}",
            *(f"{getattr(stats, f'p{p}'):.0f}" for p in PERCENTILES),
            str(stats.max),
            str(limit),
            str(cut),
            str(audit.dropped),
        )
    buffer = StringIO()
    console = Console(file=buffer, width=110, force_terminal=False)
    console.print(table)
    worst = max(audit.worst_train, key=lambda s: s.tokens)
    console.print(
        f"label tokens kept (coverage): {audit.label_coverage:.2%}; worst padded training batch "
        f"({audit.sampler} sampler): {worst.describe(audit.task)}"
        + (f"; worst eval batch: {audit.worst_eval.describe(audit.task)}" if audit.worst_eval else "")
    )
    if audit.label_lost_truncate or audit.label_lost_drop:
        console.print(
            f"{label_name.rstrip('s')} tokens that over-long samples lose: {audit.label_lost_truncate} with "
            f"memory.overlength=truncate, {audit.label_lost_drop} with drop (of "
            f"{audit.label_raw.mean * audit.label_raw.count:.0f})"
        )
    return buffer.getvalue()


def plot_histogram(audit: LengthAudit, source_raw: np.ndarray, label_raw: np.ndarray, path: str) -> str:
    """Histograms of raw source and label lengths with the max-length lines drawn; saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    names = ("prompt", "response") if audit.task == "causal" else ("source", "labels")
    for ax, name, lengths, limit in zip(
        axes, names, (source_raw, label_raw), (audit.max_source_length, audit.max_label_length), strict=True
    ):
        ax.hist(lengths, bins=50, color="#4c72b0")
        ax.axvline(limit, color="#c44e52", linestyle="--", label=f"max length {limit}")
        ax.set_yscale("log")
        ax.set_xlabel(f"{name} tokens (raw)")
        ax.set_ylabel("samples")
        ax.legend()
    fig.suptitle(f"token lengths — label coverage {audit.label_coverage:.1%}, dropped {audit.dropped}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
