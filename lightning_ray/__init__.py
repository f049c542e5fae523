"""lightning_ray: train the LLM behind existing, unmodified AI agents with RL, on Ray."""

__version__ = "0.1.0"
