"""Write docs/config.md, the `mcompile train` config reference, from the config dataclasses."""

from pathlib import Path

from mcompile.apps.train.config import reference_markdown

if __name__ == "__main__":
    out = Path(__file__).resolve().parent.parent / "docs" / "config.md"
    out.write_text(reference_markdown())
    print(f"wrote {out}")
