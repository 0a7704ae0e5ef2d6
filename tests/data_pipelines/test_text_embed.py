import pytest
import torch

from genrec_spec.data_pipelines.errors import DataError
from genrec_spec.data_pipelines.text_embed import (
    EMBED_DIM,
    MiniLMEncoder,
    TextEmbedConfig,
    default_cache_dir,
    embed_texts,
)

pytestmark = pytest.mark.slow  # loads the real MiniLM encoder

TITLES = [
    "Godfather, The",
    "Godfather: Part II, The",
    "Toy Story",
    "Toy Story 2",
    "Schindler's List",
    "Star Trek: First Contact",
    "Star Trek: The Wrath of Khan",
]


class CountingEncoder(MiniLMEncoder):
    """The real encoder, recording every text it is asked to embed."""

    def __init__(self, max_length: int = 256) -> None:
        super().__init__(max_length=max_length)
        self.seen: list[str] = []

    def encode(self, texts):
        self.seen.extend(texts)
        return super().encode(texts)


@pytest.fixture(scope="module")
def encoder() -> CountingEncoder:
    return CountingEncoder()


def embed(texts, tmp_path, encoder=None):
    # Batches of 3, so every call with more texts runs several batches of B > 1.
    config = TextEmbedConfig(batch_size=3)
    return embed_texts(texts, config, cache_dir=tmp_path, progress=False, encoder=encoder)


def test_unit_norm_and_batch_invariant(tmp_path, encoder):
    emb = embed(TITLES, tmp_path, encoder)  # three batches of <= 3
    assert emb.shape == (len(TITLES), EMBED_DIM) and emb.dtype == torch.float32
    torch.testing.assert_close(emb.norm(dim=1), torch.ones(len(TITLES)))
    # Padding inside a batch must not change a text's vector (mean pooling honours the mask).
    alone = torch.cat([encoder.encode([t]) for t in TITLES])
    torch.testing.assert_close(emb, alone, atol=1e-5, rtol=0)


def test_similar_titles_are_closer(tmp_path, encoder):
    emb = embed(TITLES, tmp_path, encoder)
    sim = emb @ emb.T  # [I, I] cosine similarity
    for a, b in [(0, 1), (2, 3), (5, 6)]:  # sequels
        others = [j for j in range(len(TITLES)) if j not in (a, b)]
        assert sim[a, b] > sim[a, others].max() + 0.05
        assert sim[b, a] > sim[b, others].max() + 0.05


def test_cache_hit_never_loads_the_model(tmp_path, encoder):
    encoder.seen.clear()
    first = embed(TITLES + ["Toy Story"], tmp_path, encoder)
    assert sorted(encoder.seen) == sorted(TITLES)  # the repeated title is embedded once
    assert torch.equal(first[2], first[-1])

    fresh = MiniLMEncoder()
    again = embed(TITLES + ["Toy Story"], tmp_path, fresh)
    assert torch.equal(first, again)
    assert not fresh.is_loaded  # answered from the cache alone

    # Adding items embeds only the new texts; the old ones still come from the cache.
    encoder.seen.clear()
    grown = embed(["Heat", *TITLES, "Twelve Monkeys"], tmp_path, encoder)
    assert sorted(encoder.seen) == ["Heat", "Twelve Monkeys"]
    assert torch.equal(grown[1:-1], first[:-1])
    assert not list(tmp_path.rglob(".*"))  # no temporary files left behind


def test_cache_is_per_encoder_setting(tmp_path, encoder):
    assert MiniLMEncoder(max_length=8).identity != encoder.identity
    embed(TITLES[:2], tmp_path, encoder)
    short = CountingEncoder(max_length=3)  # [CLS] "godfather" [SEP]: a different encoding
    truncated = embed(TITLES[:2], tmp_path, short)
    assert short.seen == sorted(TITLES[:2], key=lambda t: -len(t))
    torch.testing.assert_close(truncated[0], truncated[1])  # both are just "godfather"


def test_empty_input_and_defaults(tmp_path, monkeypatch):
    assert embed([], tmp_path).shape == (0, EMBED_DIM)
    monkeypatch.setenv("GENREC_SPEC_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("GENREC_SPEC_CACHE")
    assert default_cache_dir().name == "genrec_spec"
    with pytest.raises(DataError, match="batch_size"):
        TextEmbedConfig(batch_size=0)
