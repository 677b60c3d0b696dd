"""Evaluation metrics as small pure functions: pass@k, legibility to the junior, drift from the base.

Definitions, units and directions are documented in docs/metrics.md; each function names its naive
equivalent in its docstring and is tested against it in tests/metrics/. Import from the modules themselves
(`tandem.metrics.passk`, `.drift`, `.legibility`, `.intervals`, `.claims`, `.verdicts`): the package imports none of them,
so a reader of pass@k or the claims (the report stage, numpy only) does not pay for importing torch, which
`drift` and `legibility` need.
"""
