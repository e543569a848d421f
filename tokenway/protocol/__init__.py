"""Wire schemas only: openai.py (OpenAI-compatible bodies), anthropic.py (Messages API) and
errors.py (the one error tree every client-visible failure belongs to). No server or engine code."""
