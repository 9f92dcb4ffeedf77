"""Share: what leaves the machine — notebook rendering, export, the issue summary, the scrubber, the
environment manifest and figure export.
"""
