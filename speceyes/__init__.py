"""speceyes: speculative perception and planning for agentic vision-language models."""

__version__ = "0.1.0"
