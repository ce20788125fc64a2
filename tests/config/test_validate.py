"""Every shipped option composes and validates; bad values give one line naming the field and the fix."""

from __future__ import annotations

import importlib.util
import re

import pytest
from omegaconf import OmegaConf

from memfit.config import ConfigError, effective_lengths, validate
from memfit.config.schema import memory_knobs
from tests.conftest import CONF, run_train_py, write_jsonl


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _data_overrides(option: str, tmp_path) -> list[str]:
    if option == "hub":
        return ["data.hub_id=org/name"]
    if option in ("jsonl", "csv", "parquet"):
        rows = [{"source": "a b c", "target": "d e"}] * 3
        if option == "jsonl":
            path = write_jsonl(tmp_path / "d.jsonl", rows)
        elif option == "csv":
            path = tmp_path / "d.csv"
            path.write_text("source,target\n" + "a b c,d e\n" * 3)
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            path = tmp_path / "d.parquet"
            pq.write_table(pa.Table.from_pylist(rows), path)
        return [f"data.path={path}"]
    return []


@pytest.mark.parametrize("group", ["model", "data", "memory", "trainer", "tracking"])
def test_every_shipped_option_composes_and_validates(compose_cfg, tmp_path, group):
    options = _options(group)
    assert options, f"conf/{group} is empty"
    for option in options:
        extra = _data_overrides(option, tmp_path) if group == "data" else []
        if group == "memory" and option == "qlora":
            extra.append("model=qwen2_5_0_5b")  # 4-bit base weights train through LoRA
        if group == "model" and option == "local":  # a checkpoint directory: validation reads its config.json
            checkpoint = tmp_path / "checkpoint"
            checkpoint.mkdir(exist_ok=True)
            (checkpoint / "config.json").write_text('{"model_type": "qwen2", "max_position_embeddings": 2048}')
            (checkpoint / "tokenizer.json").write_text("{}")
            extra.append(f"model.name_or_path={checkpoint}")
        cfg = compose_cfg(f"{group}={option}", *extra)
        assert cfg[group].get("name", option) == option or group in ("trainer", "tracking")
        try:  # the config itself is sound; device needs are tested below
            validate(cfg, cuda_available=True)
        except ConfigError as err:  # only the `gpu` extra this machine may lack (bitsandbytes for memory=qlora)
            assert all("pip install 'memfit[gpu]'" in problem for problem in err.problems), err.problems


def test_every_memory_knob_is_set_and_commented_with_its_trade_off_in_every_policy():
    for path in (CONF / "memory").glob("*.yaml"):
        set_here = {}
        for line in path.read_text().splitlines():
            if line.startswith("  ") and not line.startswith("   ") and ":" in line:
                set_here[line.split(":", 1)[0].strip()] = line
            elif line.startswith("    ") and line.strip()[:1] not in ("#", ""):  # model.lora's, set by a policy
                assert "#" in line, f"{path.name}: knob without a trade-off comment: {line}"
        for name in memory_knobs():
            assert name in set_here, f"{path.name} does not set memory.{name}"
            assert "#" in set_here[name], f"{path.name}: knob without a trade-off comment: {set_here[name]}"


def test_config_comments_say_a_trade_off_in_two_lines_and_name_no_session_or_card():
    """A knob's comment is its trade-off in at most two lines; what measured it lives in docs/ and benchmarks/."""
    history = re.compile(r"session \d|H100|H200|\brun \d+\b|issue \d", re.IGNORECASE)
    for path in sorted(CONF.rglob("*.yaml")):
        run = 0
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            assert not history.search(line), f"{path.relative_to(CONF)}:{number}: {line.strip()}"
            continued = line.lstrip().startswith("#") and line.startswith("  ")
            run = run + 1 if continued else (1 if "#" in line and line.strip()[:1] not in ("#", "") else 0)
            if path.parent.name in ("memory", "trainer"):
                assert run <= 2, f"{path.relative_to(CONF)}:{number}: a comment past two lines"


def test_every_memory_field_declares_what_it_means_for_calibration_device_and_probe():
    from dataclasses import fields

    from memfit.config.schema import APPLIED_BY, MemoryConfig
    from memfit.memory.calibration import POLICY_KNOBS
    from memfit.memory.probe import APPLIED_AS_TRAINER

    assert {f.name for f in fields(MemoryConfig)} == {"name", *memory_knobs()}
    assert all(knob.applied_by in APPLIED_BY for knob in memory_knobs().values())
    assert set(POLICY_KNOBS) == {name for name, knob in memory_knobs().items() if knob.step}
    trainer_step_knobs = {n for n, k in memory_knobs().items() if k.step and k.applied_by == "trainer"}
    assert trainer_step_knobs == set(APPLIED_AS_TRAINER), "a step knob Trainer applies must be applied by the probe"


def test_the_composed_config_lists_no_removed_key(compose_cfg):
    from omegaconf import OmegaConf

    from memfit.config.hydra_errors import REMOVED_KEYS

    job = OmegaConf.to_yaml(compose_cfg())
    assert not [key for key in REMOVED_KEYS if f"{key.rsplit('.', 1)[1]}:" in job]
    assert "packing:" not in job


def test_a_policy_sets_lora_through_model_lora_and_the_command_line_still_wins(compose_cfg):
    tight = compose_cfg("model=qwen2_5_0_5b", "memory=tight")
    assert tight.model.lora.r == 8 and list(tight.model.lora.target_modules) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    mine = compose_cfg("model=qwen2_5_0_5b", "memory=tight", "model.lora.r=32")
    assert mine.model.lora.r == 32
    assert compose_cfg("model=qwen2_5_0_5b", "memory=balanced").model.lora.r == 16  # the model's own


def test_cfg_job_shows_the_policy_knobs():
    out = run_train_py("--cfg", "job", "memory=tight", timeout=120)
    assert out.returncode == 0, out.stderr
    shown = OmegaConf.create(out.stdout)
    assert shown.memory.name == "tight"
    assert shown.memory.gradient_checkpointing is True
    assert shown.memory.max_label_length == "auto"


@pytest.mark.parametrize("policy", ["off", "balanced", "tight", "qlora"])
def test_every_policy_derives_its_lengths_and_null_or_auto_start_at_the_model_limit(compose_cfg, policy):
    """auto (every policy's default) and null both start at the model's limit; auto's budget cut comes once the
    model is measured (memfit.run.auto_lengths)."""
    cfg = compose_cfg(f"memory={policy}")
    assert (cfg.memory.max_source_length, cfg.memory.max_label_length) == ("auto", "auto")
    assert effective_lengths(cfg) == (512, 512)
    assert effective_lengths(compose_cfg(f"memory={policy}", "model=tiny_causal")) == (1024, 1024)
    nulls = compose_cfg(f"memory={policy}", "memory.max_source_length=null", "memory.max_label_length=null")
    assert effective_lengths(nulls) == (512, 512)


BAD = [
    (["memory.max_label_length=0"], "memory.max_label_length=0 must be > 0"),
    (["memory.max_source_length=-5"], "memory.max_source_length=-5 must be > 0"),
    (["memory.max_source_length=4096"], "memory.max_source_length=4096 exceeds minilm_bert2bert's 512 positions"),
    (
        ["memory.max_label_length=long"],
        "memory.max_label_length='long' is not a length: set memory.max_label_length=auto (the model's limit, cut "
        "only where the budget needs it), a number of tokens such as 512, or null (the model's limit)",
    ),
    (["memory.max_source_length=12.5"], "memory.max_source_length=12.5 is not a length"),
    (["trainer.batch_size=0"], "trainer.batch_size=0 must be > 0"),
    (["budget.gib=0"], "budget.gib=0 must be > 0"),
    (["budget.gib=-3"], "budget.gib=-3 must be > 0"),
    (["budget.gib=0.3"], "budget.margin_gib=0.5 leaves nothing of budget.gib=0.3 to judge peaks against"),
    (["data=jsonl", "data.path=/nonexistent/my.jsonl"], "data.path=/nonexistent/my.jsonl: no such file"),
    (["memory.optimizer=lion"], "memory.optimizer='lion' is not one of"),
    (["memory.overlength=clip"], "memory.overlength='clip' is not one of"),
    (
        ["model=tiny_causal", "memory.load_in_4bit=true", "trainer.device=cpu"],
        "memory.load_in_4bit=true needs a CUDA GPU",
    ),
    (["memory.optimizer=adamw_8bit", "trainer.device=cpu"], "memory.optimizer=adamw_8bit needs a CUDA GPU"),
    (["memory.loss=fused", "trainer.device=cpu"], "memory.loss=fused needs a CUDA GPU: use memory.loss=chunked"),
    (
        ["memory.layer_kernels=liger", "trainer.device=cpu"],
        "memory.layer_kernels=liger needs a CUDA GPU: use memory.layer_kernels=standard",
    ),
    (["memory.layer_kernels=triton"], "memory.layer_kernels='triton' is not one of"),
    (["trainer.max_steps=0"], "trainer.max_steps/num_train_epochs give no training"),
    (["trainer.warmup_steps=-1"], "trainer.warmup_steps=-1 must be >= 0: use 0 for none"),
    (["trainer.weight_decay=-0.1"], "trainer.weight_decay=-0.1 must be >= 0"),
    (["trainer.dataloader_num_workers=-1"], "trainer.dataloader_num_workers=-1 must be >= 0"),
    (["trainer.pad_tolerance=0"], "trainer.pad_tolerance=0.0 must be > 0: use e.g. 0.1, or null for none"),
    (["data.targets=[summary]"], "data.targets has 'summary'"),
    (["model=local", "model.name_or_path=/no/ckpt"], "model.name_or_path=/no/ckpt does not exist"),
]


@pytest.mark.parametrize(("overrides", "expected"), BAD)
def test_bad_values_name_the_field(compose_cfg, overrides, expected):
    cfg = compose_cfg(*overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, cuda_available=False)
    assert any(expected in line for line in err.value.problems), err.value.problems


@pytest.mark.parametrize(
    ("overrides", "package", "expected"),
    [
        (
            ["memory.loss=fused"],
            "liger_kernel",
            "memory.loss=fused needs liger-kernel: pip install 'memfit[gpu]', or use memory.loss=chunked",
        ),
        (
            ["memory.layer_kernels=liger"],
            "liger_kernel",
            "memory.layer_kernels=liger needs liger-kernel: pip install 'memfit[gpu]', or use "
            "memory.layer_kernels=standard",
        ),
        (
            ["memory.optimizer=adamw_8bit"],
            "bitsandbytes",
            "memory.optimizer=adamw_8bit needs bitsandbytes: pip install 'memfit[gpu]', or use memory.optimizer=adamw "
            "or adafactor",
        ),
        (
            ["memory=qlora", "model=tiny_causal"],
            "bitsandbytes",
            "memory.load_in_4bit=true needs bitsandbytes: pip install 'memfit[gpu]', or use memory=tight",
        ),
    ],
)
def test_a_gpu_knob_without_its_package_says_how_to_get_it(compose_cfg, overrides, package, expected):
    """On a CUDA machine without the `gpu` extra: one line per knob, from its declaration (Knob.package)."""
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    cfg = compose_cfg(*overrides, "trainer.device=auto")
    with pytest.raises(ConfigError) as err:
        validate(cfg, cuda_available=True)
    assert expected in err.value.problems


def test_every_problem_is_reported_at_once(compose_cfg):
    cfg = compose_cfg("trainer.batch_size=0", "budget.gib=0", "memory.max_label_length=0")
    with pytest.raises(ConfigError) as err:
        validate(cfg, cuda_available=False)
    assert len(err.value.problems) == 3


def test_missing_column_is_named(compose_cfg, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a", "summary": "b"}])
    cfg = compose_cfg("data=jsonl", f"data.path={path}")
    with pytest.raises(ConfigError) as err:
        validate(cfg, cuda_available=False)
    assert "data.source_column='source' is not a column" in str(err.value)
    assert "data.target_column='target' is not a column" in str(err.value)


@pytest.mark.parametrize(
    ("override", "last_line"),
    [
        (
            "memory.max_lable_length=64",
            "memory.max_lable_length is not a config key: did you mean memory.max_label_length?",
        ),
        ("trainer.batch_size=1.5", "trainer.batch_size=1.5 is not an integer: set trainer.batch_size to an integer"),
        (
            "memory.causal_padding_mask=maybe",
            "memory.causal_padding_mask=maybe is not true or false: set memory.causal_padding_mask to true or false",
        ),
        ("memory=tigh", "memory=tigh is not an option of memory: did you mean memory=tight?"),
        ("model.name=???", "model.name is missing (???): set model.name=<value>"),
        ("trainer.batch_size=[1", "an override does not parse (no viable alternative at input '[1')"),
        ("trainer.batch_size=0", "trainer.batch_size=0 must be > 0"),
        ("memory.no_such_knob=1", "memory.no_such_knob is not a config key (python train.py --cfg job lists them)"),
        ("memory.lora_r=8", "memory.lora_r was removed: set model.lora.r"),
    ],
)
def test_a_command_line_config_error_is_one_line_naming_the_key(tmp_path, override, last_line):
    out = run_train_py(f"output_dir={tmp_path}", override, "model=tiny_seq2seq", timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"memfit: error: {last_line}")
    assert not (tmp_path / "mlflow.db").exists()  # nothing recorded for bad input


def test_hydra_full_error_still_shows_the_full_trace():
    from tests.conftest import run_train_py

    out = run_train_py("memory.max_lable_length=64", extra_env={"HYDRA_FULL_ERROR": "1"}, timeout=120)
    assert out.returncode == 1 and "Traceback" in out.stderr and "max_lable_length" in out.stderr


def test_a_key_nothing_reads_is_named_not_trained_past(compose_cfg):
    # +key=value adds a key even where no group of that name exists: it must not train the defaults in silence
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("+trainer_batch_size=4"), cuda_available=False)
    assert err.value.problems == [
        "trainer_batch_size is not a config key (python train.py --cfg job lists them): remove +trainer_batch_size"
    ]


def test_a_preset_launched_where_no_sweep_exported_one_says_where_presets_live(tmp_path):
    out = run_train_py(f"output_dir={tmp_path}", "+preset=qwen-aclsum-24gib", cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"memfit: error: preset=qwen-aclsum-24gib: no sweeps/preset/ under {tmp_path}"), last
    (tmp_path / "sweeps" / "preset").mkdir(parents=True)  # as a clone has it: the folder, no preset yet
    out = run_train_py(f"output_dir={tmp_path}", "+preset=qwen-aclsum-24gib", cwd=tmp_path, timeout=120)
    last = out.stderr.strip().splitlines()[-1]
    assert (
        last == "memfit: error: preset=qwen-aclsum-24gib: sweeps/preset/ holds no presets yet: run the command a "
        "budget sweep printed last, or sweep with hydra.sweeper.export_to=sweeps/preset"
    ), last
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize(
    ("fmt", "content", "expected"),
    [
        ("parquet", b'{"source": "a", "target": "b"}\n', "cannot be read as parquet (Parquet magic bytes"),
        ("jsonl", b'{"source": "a", "target": \n', "line 1 is not valid JSON (Expecting value)"),
    ],
)
def test_a_data_file_that_is_not_its_format_is_named_as_such(compose_cfg, tmp_path, fmt, content, expected):
    path = tmp_path / f"my.{fmt}"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(f"data={fmt}", f"data.path={path}"), cuda_available=False)
    assert err.value.problems[0].startswith(f"data.path={path} {expected}"), err.value.problems


def test_budget_batching_on_cuda_without_expandable_segments_is_one_line(compose_cfg, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cfg = compose_cfg("model=tiny_seq2seq", "memory=off", "trainer.batching=budget")
    with pytest.raises(ConfigError) as error:
        validate(cfg, cuda_available=True)
    assert str(error.value).count("\n") == 0
    assert "memory.expandable_segments=true" in str(error.value) and "trainer.batching=fixed" in str(error.value)
    validate(cfg, cuda_available=False)  # on CPU host memory has no such cache: budget-shaped batches train
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512,expandable_segments:True")  # set by hand
    validate(cfg, cuda_available=True)
    balanced = compose_cfg("model=tiny_seq2seq", "trainer.batching=budget")  # the knob on, the user's env says off
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    with pytest.raises(ConfigError):
        validate(balanced, cuda_available=True)
