"""Diverge: where did state first go wrong? — digest comparison with a reference, the first divergence
per request, replay, the noise rule, conv continuity and the hypothesis table.
"""
