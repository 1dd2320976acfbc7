"""The README stays true: the profile reference is generated from the models, every command is listed."""

from __future__ import annotations

from pathlib import Path

from specops.cli import COMMANDS
from specops.config.docs import END, START, profile_reference
from specops.config.profile import Profile

README = Path(__file__).resolve().parent.parent / "README.md"


def test_profile_reference_in_readme_is_current():
    text = README.read_text(encoding="utf-8")
    section = text[text.index(START) + len(START) : text.index(END)].strip()
    assert section == profile_reference().strip(), "run: python -m specops.config.docs --write README.md"


def test_profile_reference_lists_every_field():
    ref = profile_reference()

    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            sub = field.annotation
            if isinstance(sub, type) and hasattr(sub, "model_fields"):
                yield from walk(sub, f"{prefix}{name}.")
            else:
                yield prefix + name

    missing = [f for f in walk(Profile) if f"`{f}`" not in ref]
    assert not missing


def test_every_command_is_in_the_cli_reference():
    text = README.read_text(encoding="utf-8")
    for name in COMMANDS:
        assert f"`specops {name}" in text or (name in ("setup",) and "specops engines" in text), name


def test_readme_opens_with_the_two_commands_ci_uses():
    text = README.read_text(encoding="utf-8")
    first_block = text[text.index("```bash") : text.index("```", text.index("```bash") + 3)]
    assert "scripts/demo" in first_block and "scripts/test" in first_block
    ci = (README.parent / ".ci" / "run").read_text()
    assert "scripts/test" in ci
