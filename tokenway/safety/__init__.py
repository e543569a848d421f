"""Moderation of input and output (DESIGN.md, stage 6 and the gateway's input check).

    detectors.py   built-in detectors for secrets and PII: detect(text) -> Findings; redact()

Not yet wired into the server.
"""

from tokenway.safety.detectors import CATEGORIES, Finding, detect, redact

__all__ = ["CATEGORIES", "Finding", "detect", "redact"]
