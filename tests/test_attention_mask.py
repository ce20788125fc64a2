"""memfit.attention_mask (memory.shared_attention_mask): a padded batch's attention mask is made once per forward
pass and kept once for the backward pass, not converted and kept by every layer; the attention is the same."""

from __future__ import annotations

import collections

import pytest
import torch

from memfit.attention_mask import share_attention_mask
from memfit.memory.model import describe_architecture
from memfit.memory.savings import mask_copies
from memfit.models import build_model, build_tokenizer


def _padded_step(compose_cfg, caplog, model: str, precision: str, shared: bool):
    """One forward and backward over a padded batch: the storages autograd keeps of each attention-mask shape, the
    loss and the trained parameters' gradients."""
    cfg = compose_cfg(
        "trainer.device=cpu",
        f"model={model}",
        "memory=balanced",
        f"memory.precision={precision}",
        f"memory.shared_attention_mask={str(shared).lower()}",
    )
    torch.manual_seed(0)
    with caplog.at_level("INFO"):
        built = build_model(cfg, build_tokenizer(cfg.model), "cpu").model.eval()  # eval: no dropout to differ
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 1000, (3, 40), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, -9:] = 0  # padded, as the worst batch always is
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}
    if cfg.model.task == "seq2seq":
        batch["labels"] = torch.randint(5, 1000, (3, 12), generator=generator)
    masks: dict[tuple, dict[int, int]] = collections.defaultdict(dict)

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 4 and t.shape[1] == 1 and t.shape[-1] == 40:  # (batch, 1, queries, keys): a mask
            masks[(tuple(t.shape), t.dtype)][t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"),
    ):
        loss = built(**batch).loss
    loss.backward()
    grads = {name: p.grad for name, p in built.named_parameters() if p.requires_grad}
    copies = {key: len(storages) for key, storages in masks.items()}
    kept = sum(sum(storages.values()) for storages in masks.values())
    predicted = mask_copies(3, 40, 12, describe_architecture(built, cfg.model.task), precision)
    return copies, loss.item(), grads, kept, predicted


@pytest.mark.parametrize("model", ["tiny_causal", "tiny_seq2seq"])  # Qwen2 under LoRA; BART (encoder and cross)
@pytest.mark.parametrize(
    ("precision", "dtype", "tolerance"), [("fp32", torch.float32, 1e-6), ("bf16", torch.bfloat16, 0)]
)
def test_a_padded_batch_keeps_one_mask_for_every_layer_with_the_same_gradients(
    compose_cfg, caplog, model, precision, dtype, tolerance
):
    per_layer, loss, grads, kept, predicted = _padded_step(compose_cfg, caplog, model, precision, shared=False)
    assert "memory.shared_attention_mask=true" not in caplog.text
    shared, shared_loss, shared_grads, kept_shared, _ = _padded_step(compose_cfg, caplog, model, precision, True)
    assert "memory.shared_attention_mask=true: one attention mask per forward pass, kept once" in caplog.text
    assert per_layer and all(copies >= 2 for copies in per_layer.values())  # a copy per layer (2 or more here)
    assert shared == {key: 1 for key in per_layer}  # the same masks, in the queries' dtype, one tensor each
    assert {key[1] for key in shared} == {dtype}  # made in autocast's dtype: no cast per layer either
    # estimate_only's and the preflight's estimate of the saving (memory.savings.mask_copies): what was saved
    assert predicted == kept - kept_shared > 0
    assert shared_loss == pytest.approx(loss, abs=tolerance)
    for name, grad in grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=tolerance, atol=tolerance, msg=name)


def test_a_model_on_another_attention_is_left_alone():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    eager = Qwen2ForCausalLM(Qwen2Config(**config.to_dict(), attn_implementation="eager"))
    assert not share_attention_mask(eager)
    assert eager.config._attn_implementation == "eager"
