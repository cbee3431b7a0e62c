"""Structured output: a grammar (JSON schema, regex, choice, Lark/GBNF) constrains each sampled token.

The front compiles the grammar once per distinct request spec (:mod:`client.structured.grammar`),
keeps one matcher per constrained sequence, and sends the worker the matcher's token bitmask with
each sampled step (``StepSequence.token_bitmask``); the worker applies it to the logits and keeps no
grammar state (DESIGN.md, one generation step).
"""

from client.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
