"""Where a process synchronises the GPU: with MEMFIT_SYNC_SITES=<file> set and this folder first on PYTHONPATH, every
synchronising CUDA call (torch.cuda.set_sync_debug_mode's warning) is counted by its Python stack, the ten deepest
frames, and the counts are written to <file> at exit, most frequent first (benchmarks/README.md, session 39).

    PYTHONPATH=benchmarks/sync_sites:$PYTHONPATH MEMFIT_SYNC_SITES=/tmp/sites.txt python train.py ...
"""

import os

if os.environ.get("MEMFIT_SYNC_SITES"):
    import atexit
    import collections
    import traceback
    import warnings

    import torch

    counts: collections.Counter = collections.Counter()
    _show = warnings._showwarnmsg  # logging.captureWarnings replaces showwarning, not this

    def _where() -> str:
        stack = [f for f in traceback.extract_stack()[:-2] if "warnings" not in f.filename]
        return "\n".join(f"  {f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in stack[-10:])

    def _count(msg: warnings.WarningMessage) -> None:
        if "synchroniz" in str(msg.message):
            counts[_where()] += 1
        else:
            _show(msg)

    def _write() -> None:
        with open(os.environ["MEMFIT_SYNC_SITES"], "w") as out:
            for stack, n in counts.most_common():
                out.write(f"{n}\n{stack}\n\n")

    warnings._showwarnmsg = _count
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode(1)
    atexit.register(_write)
