"""Validation through the real inference path: speculative decoding on held-out prompts against plain decoding,
its reports (JSON, Markdown, per-prompt outputs) and plots."""
