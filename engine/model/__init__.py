from engine.model.model import GlmDsaForCausalLM

__all__ = ["GlmDsaForCausalLM"]
