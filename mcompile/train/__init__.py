"""`mcompile train CONFIG.toml`: the training entry point (config, schedules, the loop, metrics)."""
