"""What a refused run printed on stderr: its one error line, without the progress lines of a fetch that ran first
(on an empty cache, a check that reads the data fetches it before it can refuse: h2o.assets.fetch)."""
from h2o.assets.fetch import LOG_PREFIX


def refusal(capsys) -> str:
    """stderr since the last read, less the fetch's progress lines, stripped."""
    lines = capsys.readouterr().err.splitlines()
    return "\n".join(line for line in lines if not line.startswith(LOG_PREFIX)).strip()
