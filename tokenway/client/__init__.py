"""The caller's side of an LLM API call, on the official openai and anthropic SDKs."""

from tokenway.client.counting import LocalCounter, Price, RemoteCounter, price_of

__all__ = ["LocalCounter", "Price", "RemoteCounter", "price_of"]
