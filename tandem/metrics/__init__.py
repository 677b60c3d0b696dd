"""Evaluation metrics as small pure functions: pass@k, legibility to the junior, drift from the base.

Definitions, units and directions are documented in docs/metrics.md; each function names its naive
equivalent in its docstring and is tested against it in tests/metrics/.
"""

from tandem.metrics.drift import (histogram_counts, kl_BT, per_type_sums_V, quantiles, token_logratio_BT,
                                  top_types)
from tandem.metrics.legibility import masked_row_mean_B, overlap_BT, token_nll_BT
from tandem.metrics.passk import macro_mean, mean_pass_at_k, pass_at_k, pass_at_k_P

__all__ = [
    "histogram_counts", "kl_BT", "per_type_sums_V", "quantiles", "token_logratio_BT", "top_types",
    "masked_row_mean_B", "overlap_BT", "token_nll_BT",
    "macro_mean", "mean_pass_at_k", "pass_at_k", "pass_at_k_P",
]
