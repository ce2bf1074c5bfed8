"""Analysis of run records: reads only ``runs/`` (no torch, no GPU) and regenerates the paper's
tables (``analysis.paper_tables``, each experiment's own in ``analysis.tables``), figures
(``analysis.figures``) and ``REPORT.md`` (``analysis.report``: the paper's numbers beside ours).

    python -m analysis tables  [--runs runs] [--out analysis/out]
    python -m analysis figures [--runs runs] [--out analysis/out]
    python -m analysis report  [--runs runs] [--out analysis/out]
"""
