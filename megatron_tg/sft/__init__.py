"""The supervised warm start: SFT of the policy on agent transcripts (``megatron-tg sft``)."""

from megatron_tg.sft.data import SFTExample, TranscriptError, load_transcripts, transcript_example

__all__ = ["SFTExample", "TranscriptError", "load_transcripts", "transcript_example"]
