"""Moderation of input and output (DESIGN.md, stage 6 and the gateway's input check).

    channels.py    what a request carries into the prompt, as texts to screen, and back
    normalize.py   the view the input screen matches (folded digits, spaces, look-alikes ...),
                   with its map back to the original characters
    detectors.py   built-in detectors for secrets and PII: detect(text) -> Findings; redact()
                   (keys.py: API keys and private keys; numbers.py: cards, IBANs, where numbers are)
    screen.py      the policy, the input screen, the streamed output screen
    guard.py       a guard model asked about the input; moderations.py: POST /v1/moderations
"""

from tokenway.safety.detectors import CATEGORIES, Finding, detect, redact

__all__ = ["CATEGORIES", "Finding", "detect", "redact"]
