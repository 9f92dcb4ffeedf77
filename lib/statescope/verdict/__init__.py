"""ArmVerdict: did corruption happen? — arms, degenerate-output detection, exact intervals, Fisher and
sequential tests, engagement guards, and the build x setting matrix.
"""
