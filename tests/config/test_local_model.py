"""model=local: a checkpoint directory trains with nothing but its path; its problems are one line each, exit 2."""

from __future__ import annotations

import json
import shutil

import pytest

from memfit.config import ConfigError
from memfit.config.local_model import positions_of, task_of
from memfit.run import run
from tests.conftest import FAST, readme_command, run_train_py, save_checkpoint


@pytest.mark.slow
@pytest.mark.parametrize(("model", "task"), [("tiny_causal", "causal"), ("tiny_seq2seq", "seq2seq")])
def test_a_saved_checkpoint_trains_from_its_path_alone(compose_cfg, tmp_path, caplog, model, task):
    # the README's command, its path made here
    readme = readme_command("python train.py model=local model.name_or_path=checkpoints")[2:]
    path = save_checkpoint(compose_cfg, tmp_path / "checkpoint", model)
    readme = [f"model.name_or_path={path}" if o.startswith("model.name_or_path=") else o for o in readme]
    cfg = compose_cfg(*readme, *FAST)
    with caplog.at_level("INFO"):
        report = run(cfg)
    assert report.status == "ok" and report.steps == 3
    assert cfg.model.task == task and cfg.model.max_positions in (1024, 2048)  # read from its config.json
    targets = (
        "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"
        if task == "causal"
        else "fc1, fc2, k_proj, out_proj, q_proj, v_proj"
    )
    assert f"LoRA adapts {targets}" in caplog.text  # the architecture's attention and MLP projections, listed
    if task == "causal":  # the memory model calibrates it too (once: the seq2seq architecture is a shipped one's)
        estimate = run(compose_cfg(*readme, *FAST, "estimate_only=true", "calibration.enabled=true", "tracking=none"))
        assert estimate.status == "ok" and estimate.predicted_peak_gib > 0


def test_task_and_positions_are_read_from_the_checkpoint_config():
    assert task_of({"is_encoder_decoder": True}) == "seq2seq" and task_of({"model_type": "qwen2"}) == "causal"
    assert positions_of({"max_position_embeddings": 4096}) == 4096
    assert positions_of({"n_positions": 512, "model_type": "t5"}) == 512
    assert positions_of({"model_type": "encoder-decoder", "decoder": {"max_position_embeddings": 256}}) == 256


@pytest.mark.slow
def test_a_checkpoint_directory_with_a_problem_stops_with_one_line_before_any_model_load(compose_cfg, tmp_path, caplog):
    good = save_checkpoint(compose_cfg, tmp_path / "good", "tiny_causal")
    no_config = shutil.copytree(good, tmp_path / "no_config")
    (no_config / "config.json").unlink()
    no_tokenizer = shutil.copytree(good, tmp_path / "no_tokenizer")
    for name in ("tokenizer.json", "vocab.txt"):
        (no_tokenizer / name).unlink(missing_ok=True)
    small = save_checkpoint(compose_cfg, tmp_path / "small", "tiny_causal", vocab=1000)
    not_json = shutil.copytree(good, tmp_path / "not_json")
    (not_json / "config.json").write_text("{model_type: qwen2")
    encoder = shutil.copytree(good, tmp_path / "encoder")  # an encoder's checkpoint has no LM head
    config = json.loads((encoder / "config.json").read_text())
    (encoder / "config.json").write_text(json.dumps({**config, "architectures": ["BertModel"]}))
    bad_tokenizer = shutil.copytree(good, tmp_path / "bad_tokenizer")
    (bad_tokenizer / "tokenizer.json").write_text('{"not json')
    cases = [
        (no_config, "has no config.json"),
        (no_tokenizer, "has no tokenizer files"),
        (small, "its vocabulary has 1000 entries but its tokenizer"),
        (not_json, "its config.json is not a JSON object: save the checkpoint again"),
        (encoder, "is a BertModel checkpoint, with no language-model head for a causal LM"),
        (bad_tokenizer, "its tokenizer does not load (JSONDecodeError: "),
    ]
    path, said = cases[0]  # train.py: exit 2, nothing recorded; the others raise the same lines from run()
    out = run_train_py("model=local", f"model.name_or_path={path}", f"output_dir={tmp_path / 'out'}")
    lines = [line for line in out.stderr.splitlines() if line.startswith("memfit: error")]
    assert out.returncode == 2 and len(lines) == 1 and said in lines[0], out.stderr[-1500:]
    assert not (tmp_path / "out" / "mlflow.db").exists()
    for path, said in cases[1:]:
        with caplog.at_level("INFO"), pytest.raises(ConfigError) as caught:
            run(compose_cfg("model=local", f"model.name_or_path={path}", "trainer.device=cpu"))
        assert len(str(caught.value).splitlines()) == 1 and said in str(caught.value)
        assert "LoRA adapts" not in caplog.text  # stopped before the model was built
