"""`mcompile train CONFIG.toml`: the training entry point (config, schedules, the loop, metrics).

    from mcompile.train import load_config, train
    summary = train(load_config("examples/train/llama3-tiny.toml", ["train.steps=20"]))   # on every rank

``load_config`` and the schema import no torch; ``train`` (mcompile.train.loop) is imported on first use.
"""

from mcompile.train.config import ConfigError, TrainConfig, load_config

__all__ = ["ConfigError", "TrainConfig", "load_config", "train"]


def __getattr__(name: str):
    if name == "train":
        from mcompile.train.loop import train

        return train
    raise AttributeError(f"module 'mcompile.train' has no attribute {name!r}")
