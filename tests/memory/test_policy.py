"""memfit.memory.policy: the process-wide settings a run makes before CUDA starts."""

import os

import pytest
import torch
from omegaconf import OmegaConf

import memfit.memory.policy as policy
from memfit.memory.policy import apply_attention_kernels, hidden_gpus_problem, pin_one_gpu


@pytest.mark.parametrize(
    ("visible", "launcher", "expected", "after"),
    [
        (None, None, "0", "0"),  # every GPU visible: the first
        ("2,3", None, "2", "2"),  # the first of those the user allowed
        (" 1 , 0", None, "1", "1"),
        ("3", None, None, "3"),  # already one: left alone
        ("", None, None, ""),  # none (a CPU run): left alone
        ("0,1", "2", None, "0,1"),  # torchrun / accelerate: one device per process already
    ],
)
def test_a_plain_run_keeps_one_gpu(monkeypatch, visible, launcher, expected, after):
    for name in ("CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    if launcher is not None:
        monkeypatch.setenv("WORLD_SIZE", launcher)
    assert pin_one_gpu() == expected
    assert os.environ["CUDA_VISIBLE_DEVICES"] == after


@pytest.mark.parametrize("enabled", [False, True])
def test_cudnn_attention_follows_the_policy_on_cuda_only(enabled):
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(not enabled)
        apply_attention_kernels(OmegaConf.create({"cudnn_attention": enabled}), "cpu")
        assert torch.backends.cuda.cudnn_sdp_enabled() is (not enabled)  # a CPU run changes nothing
        apply_attention_kernels(OmegaConf.create({"cudnn_attention": enabled}), "cuda")
        assert torch.backends.cuda.cudnn_sdp_enabled() is enabled
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("fast", [False, True])
def test_bf16_falls_back_to_fp32_only_on_a_cpu_without_fast_bf16(monkeypatch, fast):
    monkeypatch.setattr(policy, "cpu_runs_bf16_fast", lambda: fast)
    memory = OmegaConf.create({"precision": "bf16", "weights_dtype": "bf16", "frozen_dtype": "bf16"})
    changed = policy.fall_back_to_fp32_on_slow_cpu(memory, "cpu")
    assert changed == ([] if fast else ["precision", "weights_dtype", "frozen_dtype"])
    assert memory.precision == ("bf16" if fast else "fp32") and memory.weights_dtype == memory.precision
    assert memory.frozen_dtype == memory.precision  # LoRA's frozen base too
    on_gpu = OmegaConf.create({"precision": "bf16", "weights_dtype": "fp32", "frozen_dtype": "auto"})
    assert policy.fall_back_to_fp32_on_slow_cpu(on_gpu, "cuda") == [] and on_gpu.precision == "bf16"


def test_this_cpus_bf16_answer_matches_its_instruction_set():
    capability = torch.backends.cpu.get_cpu_capability()
    assert isinstance(policy.cpu_runs_bf16_fast(), bool)
    if capability in ("AVX2", "DEFAULT"):
        assert not policy.cpu_runs_bf16_fast()  # no AVX-512: torch multiplies bf16 in a plain loop here


@pytest.mark.parametrize(
    ("task", "expected"),
    [
        ("causal", "chunked"),  # the head over the labels only: less memory and faster (Qwen, H200)
        ("seq2seq", "standard"),  # nearly every position a label: the model's own head is fastest (Pegasus, H200)
    ],
)
def test_the_auto_loss_is_the_measured_best_for_the_model_family(task, expected):
    memory = OmegaConf.create({"loss": "auto"})
    assert policy.resolve_loss(memory, task) == expected
    assert memory.loss == expected  # the run and everything after it (calibration key, params) see the choice
    assert policy.resolve_loss(OmegaConf.create({"loss": "fused"}), task) is None  # a choice is kept


@pytest.mark.parametrize(
    ("policy_name", "task", "expected"),
    [
        ("balanced", "causal", "chunked"),
        ("balanced", "seq2seq", "standard"),
        ("qlora", "causal", "chunked"),
        ("tight", "seq2seq", "chunked"),  # memory first: every model
        ("off", "causal", "standard"),
    ],
)
def test_each_policy_trains_with_the_loss_its_yaml_promises(compose_cfg, policy_name, task, expected):
    model = "tiny_causal" if task == "causal" else "tiny_seq2seq"
    memory = compose_cfg(f"model={model}", f"memory={policy_name}").memory
    policy.resolve_loss(memory, task)
    assert memory.loss == expected


@pytest.mark.parametrize(
    ("overrides", "device", "expected"),
    [
        ([], "cuda", "budget"),  # where the benchmarks measured budget-shaped batches faster
        ([], "cpu", "fixed"),
        (["trainer.predict_with_generate=true"], "cuda", "fixed"),  # generation batches are not shaped
        (["preflight_only=true"], "cuda", "fixed"),  # the largest fixed batch that fits
        (["estimate_only=true"], "cuda", "fixed"),
        (["calibration.enabled=false"], "cuda", "fixed"),
        (["trainer.batching=fixed"], "cuda", "fixed"),  # what the user said stays
        (["trainer.batching=budget"], "cpu", "budget"),
        (["memory=off"], "cuda", "fixed"),  # no expandable segments: the cache fragments past the proof
        (["memory=off"], "cpu", "fixed"),
        (["memory=off", "trainer.batching=budget"], "cpu", "budget"),  # host memory has no such allocator
    ],
)
def test_batching_auto_is_budget_on_cuda_where_nothing_rules_the_plan_out(
    compose_cfg, monkeypatch, overrides, device, expected
):
    from memfit.memory.policy import resolve_batching

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)  # an earlier run in this process may have set it

    cfg = compose_cfg("model=tiny_seq2seq", *overrides)
    chosen = resolve_batching(cfg, device)
    assert cfg.trainer.batching == expected
    assert chosen == (expected if not any(o.startswith("trainer.batching") for o in overrides) else None)


def test_a_fixed_batch_run_on_cuda_without_expandable_segments_is_warned(compose_cfg, monkeypatch):
    from memfit.memory.policy import fragmentation_warning

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    off = compose_cfg("model=tiny_seq2seq", "memory=off", "trainer.batching=fixed")
    assert "memory.expandable_segments=false" in fragmentation_warning(off, "cuda")
    assert fragmentation_warning(off, "cpu") is None  # host memory has no such cache
    assert fragmentation_warning(compose_cfg("model=tiny_seq2seq"), "cuda") is None  # balanced grows segments


def test_a_gpu_whose_free_memory_falls_short_of_the_limit_is_warned_about_naming_the_budget_that_would_fit():
    from memfit.config import GIB, limit_bytes
    from memfit.memory.policy import shared_device_warning

    card = int(79.6 * GIB)  # an H100 80GB
    whole = limit_bytes(card, 0.5)
    assert shared_device_warning(card - GIB // 2, whole, "cuda") is None  # only this process's own context on it
    # another 70 GiB run beside this one (benchmarks/README.md "Session 50")
    warning = shared_device_warning(int(9.1 * GIB), limit_bytes(70 * GIB, 0.5), "cuda")
    assert warning is not None and "can take 9.1 GiB of the GPU, less than the 69.5 GiB" in warning
    assert "budget.gib<=9" in warning
    assert shared_device_warning(int(9.1 * GIB), limit_bytes(8 * GIB, 0.5), "cuda") is None  # a budget that fits
    assert shared_device_warning(0, whole, "cpu") is None  # the host's free memory bounds a CPU budget already


def test_a_trial_pinned_to_a_gpu_the_machine_lacks_is_one_line_not_a_silent_cpu_run():
    problem = hidden_gpus_problem("3", 2, cuda_available=False)  # hydra.sweeper.devices=[3], a host with GPUs 0, 1
    assert problem is not None and "CUDA_VISIBLE_DEVICES=3 shows none of this machine's 2 GPUs (0-1)" in problem
    assert "hydra.sweeper.devices" in problem and "trainer.device=cpu" in problem
    assert hidden_gpus_problem("1", 2, cuda_available=True) is None  # a GPU it has: the trial sees it
    assert hidden_gpus_problem("0", 0, cuda_available=False) is None  # no GPU at all: CPU training is what was asked
    assert hidden_gpus_problem("", 2, cuda_available=False) is None  # every GPU hidden on purpose
    assert hidden_gpus_problem(None, 2, cuda_available=False) is None


def test_training_never_waits_for_the_device_between_micro_batches(compose_cfg, tmp_path):
    """On CUDA batches are copied from pinned memory without waiting for the copy, which would stall the host's
    launching of the next kernels until the GPU had run all it was given. On CPU there is nothing to wait for."""
    from memfit.memory.policy import training_arguments

    cfg = compose_cfg("model=tiny_causal", "memory.precision=fp32")  # bf16 would ask this machine for a GPU
    cuda = training_arguments(cfg, "cuda", str(tmp_path / "cuda"), has_eval=False)
    cpu = training_arguments(cfg, "cpu", str(tmp_path / "cpu"), has_eval=False)
    assert cuda.accelerator_config.non_blocking and cuda.dataloader_pin_memory
    assert not cpu.accelerator_config.non_blocking


def test_the_allocator_env_adds_expandable_segments_and_leaves_a_users_own_setting(monkeypatch):
    from omegaconf import OmegaConf

    from memfit.memory.policy import apply_allocator_env

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.8")
    apply_allocator_env(OmegaConf.create({"expandable_segments": True}))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "garbage_collection_threshold:0.8,expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    apply_allocator_env(OmegaConf.create({"expandable_segments": True}))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"  # the user's word stands
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    apply_allocator_env(OmegaConf.create({"expandable_segments": False}))
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
