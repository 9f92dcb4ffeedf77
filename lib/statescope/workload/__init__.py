"""Workload: what the engine is asked to do — GUI-agent traces (schema, presets, episodes), the GUI
action language, screenshots and block-boundary geometry.
"""
