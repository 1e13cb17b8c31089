"""`parse`: ast.parse behind one process-wide lock.

CPython 3.11's parser is not safe to run in two threads at once: it can fail with "SystemError: AST
constructor recursion depth mismatch". The sweep grades the clean oracle in two threads, and every grading
parses sources (provenance, the independence scan, coverage and impact anchors), so every such parse in the
grader and the recorder goes through this one lock.
"""
from __future__ import annotations

import ast
import threading

__all__ = ["parse"]

_LOCK = threading.Lock()


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    with _LOCK:
        return ast.parse(source, filename)
