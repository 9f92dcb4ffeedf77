"""Teach: the guided tour of how hybrid-state caching breaks (state, align mode, in-place shift, the
accepted-count race), each section ending in a check on the real engine.
"""
