"""memfit entry point: python train.py [-m] group=option key=value (see README.md)."""

import hydra
from omegaconf import DictConfig

from memfit.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> dict:
    from memfit.run import main as run_main  # heavy imports stay out of --help and --cfg

    return run_main(cfg)


if __name__ == "__main__":
    main()
