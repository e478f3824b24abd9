"""Configuration: the model's shape (ModelConfig), the engine's frozen config tree, EngineArgs, named presets."""
