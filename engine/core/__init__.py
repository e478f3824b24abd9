"""The engine core: requests and sampling parameters, the scheduler and its output, EngineCore (scheduler + runner)."""
