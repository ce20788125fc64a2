"""How long the length audit takes on 100k samples (tokenize sources and labels, audit, worst batch), on CPU.

    python benchmarks/audit_speed.py [--samples 100000] [--out benchmarks/results/audit_speed.json]

Samples are ACLSum introduction → summary pairs, repeated to the requested count (mean source ~800 WordPiece
tokens before truncation: a heavy case for the tokenizer). The run writes a JSONL file and audits it exactly as
`python train.py data=jsonl data.path=... preflight_only=true` does before any model loads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--out", default="benchmarks/results/audit_speed.json")
    args = parser.parse_args()
    from aclsum import ACLSum
    from hydra import compose, initialize_config_dir

    from memfit.config import register_configs
    from memfit.data import load_and_tokenize
    from memfit.models import build_tokenizer

    pairs = [
        {"source": " ".join(d.sentences["introduction"]), "target": d.summaries[a]}
        for d in ACLSum("train").documents
        for a in ("challenge", "approach", "outcome")
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.jsonl"
        with path.open("w") as fh:
            for i in range(args.samples):
                fh.write(json.dumps(pairs[i % len(pairs)]) + "\n")
        register_configs()
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=["data=jsonl", f"data.path={path}", "memory=balanced"])
        tokenizer = build_tokenizer(cfg.model)
        start = time.perf_counter()
        prepared = load_and_tokenize(cfg, tokenizer)
        seconds = time.perf_counter() - start
    audit = prepared.audit
    result = {
        "samples": args.samples,
        "seconds": seconds,
        "samples_per_s": args.samples / seconds,
        "source_mean_tokens": audit.source_raw.mean,
        "worst_train_batch": [audit.worst_train[0].batch, audit.worst_train[0].source, audit.worst_train[0].label],
        "cpus": os.cpu_count(),
        "machine": platform.platform(),
        "command": "python benchmarks/audit_speed.py --samples " + str(args.samples),
    }
    print(json.dumps(result, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
