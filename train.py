"""memfit entry point: python train.py [-m] group=option key=value (see README.md)."""

import warnings

import hydra
from omegaconf import DictConfig

from memfit.config import register_configs

register_configs()
# sweeps/ (the exported presets, conf/train.yaml's searchpath) is relative to where you launch; elsewhere it is
# simply absent, and +preset=<name> then says that the preset is not found
warnings.filterwarnings("ignore", message="provider=hydra.searchpath in main, path=sweeps is not available")


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> dict:
    from memfit.run import main as run_main  # heavy imports stay out of --help and --cfg

    return run_main(cfg)


if __name__ == "__main__":
    from memfit.config.hydra_errors import run_with_one_line_errors

    run_with_one_line_errors(main)  # a config error on the command line: one line and exit 2
