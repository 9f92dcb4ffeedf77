"""CLI: the ``statescope`` command, one module per command family.
"""
