"""Capture: what runs inside vLLM while it serves — per request, step and GDN layer digests and
snapshots of the recurrent state and conv window, the copy census, prefix-cache hits and accepted
counts.
"""
