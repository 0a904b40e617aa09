"""Porting test: every ``>>>`` snippet of Fuel's tutorial pages, with imports changed.

The pages (tests/producer/fuel_docs/, Fuel's own, unchanged) run as Fuel's doctests
run: snippet after snippet in one namespace, in a scratch directory, each snippet's
printed output compared with the page's (ELLIPSIS and whitespace-insensitive, as
Fuel's doctest settings). Only the imports are rewritten (:func:`port`). Each snippet
that still fails is listed in ``KNOWN`` with its reason (the README's porting table
gives the same reasons); a snippet that starts passing must leave the list, so the list
stays exact.
"""

from __future__ import annotations

import doctest
import io
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

DOCS = Path(__file__).parent / "fuel_docs"

# Import rewrites, in order: the whole porting recipe of the README.
_REWRITES = [
    (r"from fuel\.server import start_server", "from producer import start_server"),
    (r"from fuel\.streams import ServerDataStream", "from consumer import ServerDataStream"),
    (r"from fuel import config", "from producer import config"),
    (r"\bfuel\.", "producer."),
]


def port(source: str) -> str:
    """Rewrite a snippet's Fuel imports to batchq's packages (nothing else)."""
    lines = []
    for line in source.splitlines(keepends=True):
        if re.match(r"\s*(from|import)\s+fuel\b", line):
            for pattern, replacement in _REWRITES:
                line = re.sub(pattern, replacement, line)
        lines.append(line)
    return "".join(lines)


# Snippets that fail as ported: (page, line of the snippet on the page) -> why.
_DEFAULT_ORDER = (
    "rng=None keeps batchq's own seeded order (seed 1; existing runs' plans and "
    "fingerprints depend on it): rng=numpy.random.RandomState(1) gives Fuel's default order"
)
KNOWN: dict[tuple[str, int], str] = {
    ("overview", 180): "the state's class is an implementation detail (Fuel: Python 2's imap)",
    ("overview", 339): _DEFAULT_ORDER,
    ("overview", 457): _DEFAULT_ORDER,
}

_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def snippets(page: str) -> list[doctest.Example]:
    text = (DOCS / f"{page}.rst").read_text(encoding="utf-8")
    return doctest.DocTestParser().get_examples(text, name=page)


def run_page(page: str) -> Iterator[tuple[doctest.Example, str | None]]:
    """Run a page's snippets in order; yield each with its failure (None if it passed)."""
    namespace: dict[str, Any] = {"__name__": f"fuel_docs_{page}"}
    checker = doctest.OutputChecker()
    for example in snippets(page):
        source = port(example.source)
        capture = io.StringIO()
        saved, sys.stdout = sys.stdout, capture
        failure: str | None = None
        try:
            code = compile(source, f"<{page}:{example.lineno + 1}>", "single")
            exec(code, namespace)  # the pages' own snippets
        except Exception as e:  # a snippet that raises fails, unless the page expects it
            output = capture.getvalue()
            exc_msg = traceback_line(e)
            if example.exc_msg is None or not checker.check_output(
                example.exc_msg, exc_msg, _FLAGS
            ):
                failure = f"raised {exc_msg.strip()}"
        else:
            output = capture.getvalue()
            if example.exc_msg is not None:
                failure = f"expected {example.exc_msg.strip()}, nothing raised"
            elif not checker.check_output(example.want, output, _FLAGS):
                failure = f"printed {output!r}, the page shows {example.want!r}"
        finally:
            sys.stdout = saved
        yield example, failure


def traceback_line(error: BaseException) -> str:
    return "".join(doctest.traceback.format_exception_only(type(error), error))[-1000:]


def key(page: str, example: doctest.Example) -> tuple[str, int]:
    return page, example.lineno + 1


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the pages' old numpy/h5py calls
@pytest.mark.filterwarnings("ignore:other_ds.dims.create_scale")
@pytest.mark.parametrize("page", ["overview", "extending_fuel", "h5py_dataset", "server"])
def test_fuel_doc_page_runs_with_imports_changed(
    page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("h5py")
    monkeypatch.chdir(tmp_path)
    for name in ("BATCHQ_FLOATX", "FUEL_FLOATX"):
        monkeypatch.delenv(name, raising=False)
    state, printing = np.random.get_state(), np.get_printoptions()
    # The pages show numpy 1's reprs (``2``, not numpy 2's ``np.int64(2)``).
    np.set_printoptions(legacy="1.25")
    try:
        results = list(run_page(page))
    finally:
        np.random.set_state(state)
        np.set_printoptions(**printing)
    assert results, f"no snippet found on {page}"
    unexpected = [
        f"line {ex.lineno + 1}: {ex.source.strip()[:80]!r}: {why}"
        for ex, why in results
        if why is not None and key(page, ex) not in KNOWN
    ]
    assert not unexpected, "\n".join(unexpected)
    fixed = sorted(
        {key(page, ex) for ex, why in results if why is None and key(page, ex) in KNOWN}
        - {key(page, ex) for ex, why in results if why is not None}
    )
    assert not fixed, f"these snippets pass now: remove them from KNOWN: {fixed}"
    passed = sum(why is None for _, why in results)
    print(f"{page}: {passed} of {len(results)} snippets pass as ported")
    assert os.getcwd() == str(tmp_path)
