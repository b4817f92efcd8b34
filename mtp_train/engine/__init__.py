"""The inference engine: paged KV cache, model runner, sampling and batched generation."""

from mtp_train.engine.generator import EngineGenerator, Generator, GeneratorLimits, GeneratorStats
from mtp_train.engine.kv_cache import BlockAllocator, KVCache, OutOfPagesError
from mtp_train.engine.llm import GenerationOutput, GenerationStats, LLMEngine
from mtp_train.engine.runner import ModelRunner, StepRows, prefill_hidden
from mtp_train.engine.sampling import SamplingBatch, SamplingParams, filtered_probs, sample
from mtp_train.engine.sequence import SeqStatus, Sequence

__all__ = [
    "BlockAllocator",
    "EngineGenerator",
    "GenerationOutput",
    "GenerationStats",
    "Generator",
    "GeneratorLimits",
    "GeneratorStats",
    "KVCache",
    "LLMEngine",
    "ModelRunner",
    "OutOfPagesError",
    "SamplingBatch",
    "SamplingParams",
    "SeqStatus",
    "Sequence",
    "StepRows",
    "filtered_probs",
    "prefill_hidden",
    "sample",
]
