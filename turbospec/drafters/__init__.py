"""Drafters: what proposes the tokens a verify step checks (n-gram prompt lookup, a draft model,
EAGLE / Medusa heads, their hybrid with lookup), the adaptive draft budget, and the factory that
builds one from ``Engine`` options."""
from .base import Draft, Drafter

__all__ = ["Draft", "Drafter"]
