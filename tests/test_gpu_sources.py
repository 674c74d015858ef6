"""The documents the GPU entries cite (autoshard/gpu_sources.py): each written once, each cited
by an entry, each naming where it can be read."""

from __future__ import annotations

from autoshard import gpu_sources
from autoshard.gpus import CATALOGUE


def documents() -> dict[str, str]:
    return {
        name: value
        for name, value in vars(gpu_sources).items()
        if name.isupper() and isinstance(value, str)
    }


def test_every_document_is_cited_by_an_entry() -> None:
    cited = {source for spec in CATALOGUE.values() for source in spec.sources}
    found = documents()
    assert len(found) > 10  # the module is read at all
    uncited = sorted(name for name, text in found.items() if text not in cited)
    assert not uncited, f"documents no entry cites: {uncited}"


def test_each_document_is_written_once_and_says_what_it_is() -> None:
    texts = list(documents().values())
    assert len(set(texts)) == len(texts)
    for text in texts:
        title, colon, _ = text.partition(":")
        assert colon and title.strip(), text[:60]  # "what it is: where and what it says"
