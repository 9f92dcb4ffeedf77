"""Results: readers of committed results, by the question they answer (end-to-end verdicts, the factor
check, the patch check, the capture overhead).
"""
