"""Analysis of run records: reads only ``runs/`` (no torch, no GPU) and regenerates the paper's
tables (``analysis.tables``) and figures (``analysis.figures``).

    python -m analysis tables  [--runs runs] [--out analysis/out]
    python -m analysis figures [--runs runs] [--out analysis/out]
"""
