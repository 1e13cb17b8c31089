"""One file per model family; `loading` reads HF checkpoint directories."""

__all__: list[str] = []
