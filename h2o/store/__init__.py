"""Store: what the harness keeps on disk and how. Run record folders (their names and when one is finished),
a record's identity (what makes two configs one run), durable files (atomic writes, JSON, one-line appends),
locks (flock, or an O_EXCL lock file with a heartbeat), and a run's environment facts (env.json).

Imports core, cli and assets' paths at most; never tasks, bench, parity or pipeline."""
