"""Bringing a group up: the rendezvous store, ``init`` (facts gathered, settings agreed, links
connected) and the link measurements taken at start-up."""
