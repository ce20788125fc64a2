"""A run that trained keeps what it trained: saved under output_dir/models/<run name>/ and in its MLflow run, loadable
with transformers (or peft) alone, its logits those of the model as training left it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from memfit.run import run
from memfit.tracking import default_tracking_uri
from tests.conftest import FAST, readme_command, run_train_py, save_checkpoint, write_jsonl

pytestmark = pytest.mark.slow

INPUT_IDS = torch.tensor([[101, 2023, 2003, 1037, 3231, 102]])


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            return model(input_ids=INPUT_IDS, decoder_input_ids=INPUT_IDS[:, :4]).logits
        return model(input_ids=INPUT_IDS).logits


def _trained_logits_callback():
    """The trained model's logits when training ends, before anything is saved (a merge changes the model)."""
    from transformers import TrainerCallback

    class Capture(TrainerCallback):
        logits: torch.Tensor | None = None

        def on_train_end(self, args, state, control, model=None, **kwargs):
            Capture.logits = _logits(model)
            model.train()

    return Capture()


def test_a_full_fine_tune_saves_the_model_and_tokenizer_it_trained(compose_cfg, caplog):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    cfg = compose_cfg("model=tiny_seq2seq", *FAST)
    capture = _trained_logits_callback()
    with caplog.at_level("INFO", logger="memfit"):
        report = run(cfg, callbacks=[capture])
    saved = Path(cfg.output_dir) / "models" / "tiny_seq2seq-balanced-b2"
    assert report.status == "ok" and report.saved_model == str(saved)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(saved)
    torch.testing.assert_close(_logits(loaded), capture.logits, atol=1e-5, rtol=0)
    assert len(AutoTokenizer.from_pretrained(saved)) == 30522
    record = json.loads((saved / "memfit.json").read_text())
    assert record["steps"] == 3 and record["label_coverage"] == report.label_coverage
    assert record["worst_case_peak_gib"] == report.worst_case_peak_gib > 0
    assert record["config"]["model"]["name"] == "tiny_seq2seq" and record["random_base_weights"] is True
    last = caplog.records[-1].getMessage()
    assert last == f"saved the trained model to {saved}: load it with AutoModelForSeq2SeqLM.from_pretrained('{saved}')"
    client = MlflowClient(default_tracking_uri(cfg.output_dir))
    artifacts = {a.path for a in client.list_artifacts(report.run_id, "model")}
    assert {"model/model.safetensors", "model/memfit.json", "model/tokenizer.json"} <= artifacts
    assert client.get_run(report.run_id).data.tags["memfit.saved_model"] == str(saved)


def test_a_lora_run_saves_its_adapter_and_the_merged_model(compose_cfg, tmp_path, caplog):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = save_checkpoint(compose_cfg, tmp_path / "tiny-base", "tiny_causal")
    cfg = compose_cfg(
        "model=local", f"model.name_or_path={base}", *FAST, "model.lora.merge_on_save=true", "tracking=none"
    )
    capture = _trained_logits_callback()
    with caplog.at_level("INFO", logger="memfit"):
        report = run(cfg, callbacks=[capture])
    saved = Path(report.saved_model)
    assert saved.name == "local-tiny-base-balanced-b2"  # the checkpoint's name is in the run's
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), saved)
    torch.testing.assert_close(_logits(adapter), capture.logits, atol=1e-5, rtol=0)
    assert not torch.allclose(_logits(AutoModelForCausalLM.from_pretrained(base)), capture.logits)  # it trained
    merged = AutoModelForCausalLM.from_pretrained(saved / "merged")
    torch.testing.assert_close(_logits(merged), capture.logits, atol=1e-5, rtol=0)
    assert (saved / "adapter_config.json").is_file() and not (saved / "model.safetensors").exists()
    assert caplog.records[-1].getMessage().endswith(f"AutoModelForCausalLM.from_pretrained('{saved / 'merged'}')")


def test_a_rerun_replaces_its_saved_model_and_says_so_and_none_saves_nothing(compose_cfg, caplog):
    cfg = compose_cfg("model=tiny_causal", *FAST, "trainer.max_steps=1", "tracking=none")
    first = run(cfg)
    with caplog.at_level("INFO", logger="memfit"):
        again = run(cfg)
    assert first.saved_model == again.saved_model and (Path(again.saved_model) / "adapter_config.json").is_file()
    assert f"replacing the model saved earlier at {again.saved_model}" in caplog.text
    assert "trained on random base weights" in caplog.text  # an adapter of random weights is said to be so
    assert not list(Path(again.saved_model).parent.glob(".*partial"))
    nothing = compose_cfg("model=tiny_causal", *FAST, "trainer.max_steps=1", "tracking=none", "trainer.save_model=none",
                          "tracking.run_name=unsaved")  # fmt: skip
    assert run(nothing).saved_model is None and not (Path(cfg.output_dir) / "models" / "unsaved").exists()


def _cache_a_hub_model(compose_cfg, hf_home: Path, repo_id: str) -> Path:
    """A tiny checkpoint placed in a Hugging Face cache as the Hub's client leaves a downloaded snapshot."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    save_checkpoint(compose_cfg, repo / "snapshots" / commit, "tiny_causal")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def test_a_hub_id_trains_from_the_cache_offline_and_an_uncached_one_is_one_line(compose_cfg, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf_home = tmp_path / "hf"
    snapshot = _cache_a_hub_model(compose_cfg, hf_home, "memfit-test/tiny-causal")
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    rows = [{"prompt": f"Question {i}: what is " + "word " * 8, "response": "An answer " * 4} for i in range(12)]
    data = write_jsonl(tmp_path / "my.jsonl", rows)
    swap = {"model.name_or_path": "memfit-test/tiny-causal", "data.path": str(data), "budget.gib": "4"}
    readme = readme_command("python train.py model=local model.name_or_path=Qwen/")[2:]  # the README's, on a tiny id
    readme = [f"{o.split('=')[0]}={swap[o.split('=')[0]]}" if o.split("=")[0] in swap else o for o in readme]
    out = run_train_py(
        *readme, f"output_dir={tmp_path / 'out'}", *FAST, "trainer.max_steps=1", "tracking=none", fresh=True,
        extra_env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    saved = tmp_path / "out" / "models" / "local-tiny-causal-balanced-b2-4GiB"
    assert "load it with PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained('memfit-test/tiny-causal')" in (
        out.stderr + out.stdout
    )
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(snapshot), saved)  # the adapter fits its base
    missing = run_train_py(
        f"output_dir={tmp_path / 'out'}", "model=local", "model.name_or_path=memfit-test/not-cached",
        fresh=True, extra_env=env, timeout=300,
    )  # fmt: skip
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert (
        missing.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "memfit: error: model.name_or_path=memfit-test/not-cached is not a directory, and the hub model of that id "
            f"is not in the cache ({hf_home / 'hub'}) while HF_HUB_OFFLINE=1 is set: download it"
        )
    )


def test_a_killed_runs_last_checkpoint_is_saved_by_resuming_it_to_its_own_step(compose_cfg):
    """A run that stopped after checkpoint-2 (here: trained 2 steps, saving nothing): resumed with max_steps at that
    step, it trains no further and saves the checkpoint's model as a finished run would have."""
    from safetensors.torch import load_file

    common = ("model=tiny_seq2seq", *FAST, "trainer.save_steps=2", "trainer.max_steps=2", "tracking=none")
    first = run(compose_cfg(*common, "trainer.save_model=none"))
    assert first.status == "ok" and first.saved_model is None
    exported = run(compose_cfg(*common, "trainer.resume=true"))
    assert exported.status == "ok" and exported.steps == 2
    checkpoint = Path(compose_cfg().output_dir) / "checkpoints" / "tiny_seq2seq-balanced-b2" / "checkpoint-2"
    saved, trained = (
        load_file(Path(exported.saved_model) / "model.safetensors"),
        load_file(checkpoint / "model.safetensors"),
    )
    assert saved.keys() == trained.keys() and all(torch.equal(saved[k], trained[k]) for k in saved)


def test_save_model_best_saves_the_checkpoint_of_lowest_eval_loss(compose_cfg):
    from safetensors.torch import load_file

    cfg = compose_cfg(
        "model=tiny_seq2seq", *FAST, "trainer.max_steps=4", "trainer.eval_steps=2", "trainer.save_steps=2",
        "trainer.save_model=best", "tracking=none",
    )  # fmt: skip
    report = run(cfg)
    checkpoints = Path(cfg.output_dir) / "checkpoints" / "tiny_seq2seq-balanced-b2"
    state = json.loads((checkpoints / "checkpoint-4" / "trainer_state.json").read_text())
    best = Path(state["best_model_checkpoint"])
    assert report.status == "ok" and best.name in ("checkpoint-2", "checkpoint-4")
    saved, kept = load_file(Path(report.saved_model) / "model.safetensors"), load_file(best / "model.safetensors")
    assert all(torch.equal(saved[k], kept[k]) for k in kept)


def test_save_model_best_without_eval_and_save_steps_is_one_line(compose_cfg):
    from memfit.config import ConfigError, validate

    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("model=tiny_seq2seq", "trainer.save_model=best"), cuda_available=False)
    assert err.value.problems == [
        "trainer.save_model=best keeps the checkpoint with the lowest eval loss: set trainer.eval_steps and "
        "trainer.save_steps (a multiple of eval_steps), e.g. eval_steps=50 save_steps=50"
    ]


def test_the_saved_record_holds_no_password_of_a_url(compose_cfg):
    cfg = compose_cfg("model=tiny_causal", *FAST, "trainer.max_steps=1", "tracking=none",
                      "tracking.uri=http://user:s3cret@127.0.0.1:9")  # fmt: skip
    report = run(cfg)
    record = (Path(report.saved_model) / "memfit.json").read_text()
    assert "s3cret" not in record and "http://user:***@127.0.0.1:9" in record
