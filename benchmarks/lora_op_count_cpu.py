"""How many operations a qwen2_5_1_5b LoRA micro-batch dispatches, and how many of them LoRA's: the count behind a
host-bound step (benchmarks/README.md, session 39). Each operation costs the host its dispatch (and on a GPU a
kernel launch for most), whatever its size, so the count bounds what fewer, fused operations could save.

    python benchmarks/lora_op_count_cpu.py --tokenizer .gpu/tok --out benchmarks/results/lora_op_count_cpu.json

The model is qwen2_5_1_5b's 28 layers and seven LoRA targets at a width of 64 (the operations are the true model's;
only their sizes shrink), `memory=balanced` with the chunked loss, a padded batch of 2 × 32 tokens, the loss told
its label count as training tells it (without its padding mask where memory.causal_padding_mask=false, as the
collator hands it over). Every aten operation of one forward and one backward pass is counted by name
(a TorchDispatchMode), once with the adapters and once with peft's adapters disabled.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from lora_host_cost_cpu import VARIANTS as HOST_COST_VARIANTS  # noqa: E402
from lora_host_cost_cpu import narrow_qwen  # noqa: E402
from token_steps_convergence_cpu import compose  # noqa: E402

COUNTED = ("balanced", "lora dropout 0", "memory.recompute_lora_dropout=false")  # the knobs that change LoRA's
VARIANTS = {name: HOST_COST_VARIANTS[name] for name in COUNTED}
# session 44's two knobs off: peft's own update (a scaled copy and a separate sum) and the padding mask
VARIANTS["memory.fused_lora_update=false, causal_padding_mask=true"] = [
    "memory.fused_lora_update=false",
    "memory.causal_padding_mask=true",
]


def count_step(model, batch: dict, positions: int) -> tuple[collections.Counter, collections.Counter]:
    """The aten operations of one forward and one backward pass, by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from memfit.memory.loss import model_loss

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    model_loss(model, batch, "causal").backward()  # a first step: lazy initialisation is not counted
    with Count() as forward:
        loss = model_loss(model, batch, "causal", positions=positions)
    with Count() as backward:
        loss.backward()
    return forward.ops, backward.ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", required=True, help="a local tokenizer of 30,522 entries (.gpu/tok)")
    parser.add_argument("--out", default="benchmarks/results/lora_op_count_cpu.json")
    args = parser.parse_args()
    import torch

    from memfit.data.collate import CountingCollator, loss_positions
    from memfit.models import build_model, build_tokenizer

    narrow = [
        *narrow_qwen(args.tokenizer),
        "memory=balanced",
        "memory.precision=fp32",
        "trainer.device=cpu",
        "output_dir=/tmp/memfit-lora-op-count",
    ]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (2, 32), generator=generator)
    labels = ids.clone()
    labels[:, :16] = -100  # the prompt
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # padding
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    positions = int(loss_positions(labels, "causal"))
    results: dict = {"command": " ".join(sys.argv), "variants": {}}
    for name, extra in VARIANTS.items():
        cfg = compose([*narrow, *extra])
        tokenizer = build_tokenizer(cfg.model)
        model = build_model(cfg, tokenizer, "cpu").model.train()
        # the embeddings' output asks for a gradient, so that with the adapters off the backward pass still runs
        # through every layer, as LoRA's does to reach its adapters
        model.get_base_model().enable_input_require_grads()
        # the batch as training's collator hands it over: without its mask where memory.causal_padding_mask=false
        collator = CountingCollator(tokenizer, None, "causal", cfg.memory.causal_padding_mask)
        taken = {k: v for k, v in batch.items() if not (k == "attention_mask" and collator.drops_padding_mask)}
        forward, backward = count_step(model, taken, positions)
        with model.disable_adapter():
            base_forward, base_backward = count_step(model, taken, positions)
        row = {
            "forward": sum(forward.values()),
            "backward": sum(backward.values()),
            "forward_without_adapters": sum(base_forward.values()),
            "backward_without_adapters": sum(base_backward.values()),
            "forward_by_name": dict(forward.most_common(15)),
        }
        results["variants"][name] = row
        base = f"{row['forward_without_adapters']} + {row['backward_without_adapters']}"
        print(f"{name}: {row['forward']} + {row['backward']} operations, {base} with the adapters off", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
