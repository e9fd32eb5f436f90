"""Compute-optimal scaling: FLOP/parameter accounting (`flops`), budgets (`budget`), the
family of model sizes a sweep trains (`sizes`) and scaling-law fits (`fit`). See
docs/scaling.md."""
