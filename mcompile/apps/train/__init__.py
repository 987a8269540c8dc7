"""`mcompile train CONFIG.toml`: the training entry point (config, schedules, the loop, metrics).

    from mcompile.apps.train import load_config, train
    summary = train(load_config("examples/train/llama3-tiny.toml", ["train.steps=20"]))   # on every rank

``load_config`` and the schema import no torch; ``train`` (mcompile.apps.train.loop) is imported on first use.
"""

from mcompile.apps.train.config import ConfigError, TrainConfig, load_config

__all__ = ["ConfigError", "TrainConfig", "load_config", "train"]


def __getattr__(name: str):
    if name == "train":
        from mcompile.apps.train.loop import train

        return train
    raise AttributeError(f"module 'mcompile.apps.train' has no attribute {name!r}")
