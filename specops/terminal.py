"""Text from outside (clients, Prometheus labels, state files) made safe to print on one terminal line."""

from __future__ import annotations

__all__ = ["one_line"]


def one_line(value, limit: int = 200) -> str:
    """``value`` as one printable line of at most ``limit`` characters.

    Whatever a client or a scraped target sent (class keys, label values, reasons quoting them) reaches the
    terminal escaped: no control sequence (C0, C1 such as U+009B) or bidi override (U+202E) can move the cursor
    or reorder the line. A value that is not text or a number is shown by its type's name.
    """
    text = (
        value
        if isinstance(value, str)
        else str(value)
        if type(value) in (int, float, bool) or value is None
        else type(value).__name__
    )
    text = " ".join(text.split())  # one line, whatever the source holds
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return text if text.isprintable() else "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
