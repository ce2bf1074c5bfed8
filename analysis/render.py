"""A rendered table: title, caption lines, header and string cells, as Markdown or LaTeX."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MISSING = "—"  # shown in every cell whose run is absent; never dropped


@dataclass
class Table:
    name: str                 # file stem: analysis/out/tables/<name>.md and .tex
    title: str                # e.g. "Table 1: accuracy, full cache vs policies at budget 0.2"
    header: list[str]
    rows: list[list[str]]
    caption: list[str] = field(default_factory=list)  # settings: budget, shots, n, models

    def to_markdown(self) -> str:
        def line(cells):
            return "| " + " | ".join(str(c) for c in cells) + " |"
        sep = "|" + "|".join("---" for _ in self.header) + "|"
        body = [line(self.header), sep] + [line(r) for r in self.rows]
        notes = "\n".join(f"- {c}" for c in self.caption)
        return f"**{self.title}**\n\n{notes}\n\n" + "\n".join(body) + "\n"

    def to_latex(self) -> str:
        spec = "l" * len(self.header)
        body = [" & ".join(_tex(c) for c in r) + r" \\" for r in self.rows]
        caption = _tex(self.title) + ". " + "; ".join(_tex(c) for c in self.caption)
        return "\n".join([
            r"\begin{table}[t]", r"\centering", rf"\caption{{{caption}}}",
            rf"\label{{tab:{self.name}}}", rf"\begin{{tabular}}{{{spec}}}", r"\toprule",
            " & ".join(_tex(h) for h in self.header) + r" \\", r"\midrule",
            *body, r"\bottomrule", r"\end{tabular}", r"\end{table}", ""])

    def write(self, folder: str | Path) -> list[Path]:
        """Write ``<name>.md`` and ``<name>.tex`` into ``folder``; return both paths."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        md, tex = folder / f"{self.name}.md", folder / f"{self.name}.tex"
        md.write_text(self.to_markdown())
        tex.write_text(self.to_latex())
        return [md, tex]


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#",
        "_": r"\_", "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\^{}",
        MISSING: "---", "±": r"$\pm$", "×": r"$\times$", "–": "--", "·": r"$\cdot$",
        "†": r"$^\dagger$", "−": "$-$"}


def _tex(text) -> str:
    return "".join(_TEX.get(ch, ch) for ch in str(text))
