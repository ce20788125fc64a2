"""Progress bars for long work (tokenization, preflight probes, the max-batch search, sweeps): rich, on stderr,
quiet when CI is set so that logs stay readable. Training's own bar is the Trainer's tqdm, quiet under CI as well."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator


def quiet() -> bool:
    """No bars under CI (GitHub Actions, GitLab and most CI systems set CI); logs keep the one-line summaries."""
    return bool(os.environ.get("CI"))


@contextlib.contextmanager
def progress_bar(description: str, total: int | None) -> Iterator[Callable[..., None]]:
    """A bar for `total` units of work (None: of unknown length). Yields update(advance=0, completed=None, note=''),
    where note is shown beside the bar: the shape being probed, the best value so far."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=quiet(),
    )
    task = progress.add_task(description, total=total, note="")

    def update(advance: int = 0, completed: int | None = None, note: str = "") -> None:
        progress.update(task, advance=advance, completed=completed, note=note)

    with progress:
        yield update
